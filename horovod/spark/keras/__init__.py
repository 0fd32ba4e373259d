"""Horovod's Keras estimator for Spark: ``KerasEstimator(...).fit(df)`` -> ``KerasModel`` (upstream's API).

Modules: :mod:`.estimator` (the estimator and its model, on the driver), :mod:`.remote` (what each Horovod
process runs), :mod:`.dataset` (a rank's Parquet batches as ``tf.data``), :mod:`.serialization` (models as
``.keras`` bytes), :mod:`.learning_rate` (the rate scaled by the number of processes).  docs/spark.md.
"""

from horovod.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
