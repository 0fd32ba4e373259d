"""Which Lightning: ``lightning.pytorch`` (the current package), else the older ``pytorch_lightning``."""

from __future__ import annotations

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise ImportError("horovod.spark.lightning needs Lightning: pip install 'horovod[lightning]' "
                          "(lightning>=2.0)") from e

__all__ = ["pl"]
