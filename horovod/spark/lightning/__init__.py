"""Horovod's Spark estimator for Lightning: ``TorchEstimator(model=<LightningModule>, ...).fit(df)`` -> ``TorchModel``.

Needs ``lightning`` (``pip install 'horovod[lightning]'``; the older ``pytorch_lightning`` package works too).
docs/spark.md.
"""

from horovod.spark.lightning.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
