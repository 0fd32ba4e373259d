"""Horovod's Spark estimator for plain PyTorch: ``TorchEstimator(...).fit(df)`` -> ``TorchModel`` (docs/spark.md)."""

from horovod.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
