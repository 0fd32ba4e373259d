"""Which Lightning: ``lightning.pytorch`` (the current package), else the older ``pytorch_lightning``.

Both can be installed at once -- ``pytorch_lightning`` 2.x is a second copy of the same code under its old
name, with classes of its own -- and a ``LightningModule`` of one is not one of the other, so a model is
trained with the flavour its class comes from (:func:`flavour_of`); ``pl`` is the default one.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise ImportError("horovod.spark.lightning needs Lightning: pip install 'horovod[lightning]' "
                          "(lightning>=2.0)") from e

__all__ = ["pl", "flavour_of", "FLAVOURS"]

FLAVOURS = ("lightning.pytorch", "pytorch_lightning")


def flavour_of(model: Any) -> ModuleType | None:
    """The Lightning package whose ``LightningModule`` ``model`` is (one its defining code imported), else
    None."""
    for name in FLAVOURS:
        module = sys.modules.get(name)
        if module is not None and isinstance(model, module.LightningModule):
            return module
    return None
