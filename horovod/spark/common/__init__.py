"""The framework-free layer of Horovod's Spark estimators (``horovod.spark.{torch,keras,lightning}``).

One concept per module:

* :mod:`~horovod.spark.common.store` -- ``Store``: where data, checkpoints and logs live (fsspec or a local path);
* :mod:`~horovod.spark.common.params` -- the estimators' and models' pyspark.ml parameters and accessors;
* :mod:`~horovod.spark.common.data` -- the driver writes the DataFrame as Parquet once (``prepare_data``);
* :mod:`~horovod.spark.common.reader` -- each worker reads its shard in batches (pyarrow, no Petastorm);
* :mod:`~horovod.spark.common.backend` -- ``SparkBackend`` runs the training function with ``horovod.spark.run``;
* :mod:`~horovod.spark.common.estimator` -- ``HorovodEstimator.fit`` / ``HorovodModel.transform``;
* :mod:`~horovod.spark.common.serialization` -- models saved and loaded as JSON with base64 cloudpickle.

Only the store is imported here (it needs neither pyspark nor pyarrow until used).
"""

from horovod.spark.common.store import DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore, Store

__all__ = ["Store", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore"]
