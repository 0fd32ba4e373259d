"""Keras 3 models as bytes: what the Keras estimator ships to its workers, checkpoints and returns.

The ``.keras`` format (a zip of the architecture, the compile config, the weights and the optimizer's
variables) replaces upstream's base64 HDF5: Keras 3 writes HDF5 only through a legacy path that drops
optimizer state.  Keras saves to and loads from files only, so the bytes go through a private temporary file.
Custom layers, losses and metrics load through ``custom_objects``, as upstream.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["model_to_bytes", "model_from_bytes", "CHECKPOINT_SUFFIX", "checkpoint_filename", "stored_checkpoint"]

CHECKPOINT_SUFFIX = ".keras"


def checkpoint_filename(store_filename: str | None) -> str:
    """The store's checkpoint file name with the suffix Keras 3 requires to save a whole model."""
    name = store_filename or "checkpoint"
    return name if name.endswith((".keras", ".h5")) else name + CHECKPOINT_SUFFIX


def stored_checkpoint(remote_store: Any) -> str | None:
    """Where a run keeps its Keras checkpoint in the store (``runs/<run_id>/checkpoint.keras``); None when the
    store does not keep runs.  ``remote_store``: ``Store.to_remote(run_id)``."""
    if not remote_store.saving_runs:
        return None
    return f"{remote_store.run_path}/{checkpoint_filename(remote_store.checkpoint_filename)}"


def model_to_bytes(model: Any) -> bytes:
    """The ``.keras`` bytes of ``model`` (compiled models keep their compile config and optimizer state)."""
    with tempfile.TemporaryDirectory(prefix="hvd-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def shipped_custom_objects(custom_objects: Mapping[str, Any] | None) -> dict[str, Any]:
    """``custom_objects`` plus each object under the name Keras saves it by: an object registered with
    ``keras.saving.register_keras_serializable`` is saved as ``"<package>>name"``, and the processes that load the
    model (training workers, ``transform``'s Python workers) get the object unpickled but never run the
    registration.  Called where the registration ran (the driver)."""
    import keras

    objects = dict(custom_objects or {})
    for obj in list(objects.values()):
        try:
            objects.setdefault(keras.saving.get_registered_name(obj), obj)
        except Exception:  # noqa: BLE001 - an instance (a loss object, ...) has no registered name
            continue
    return objects


def model_from_bytes(data: bytes, custom_objects: Mapping[str, Any] | None = None, *, compile: bool = True,
                     load: Callable[..., Any] | None = None) -> Any:
    """A model from :func:`model_to_bytes`' bytes.

    Args:
        custom_objects: names of the user's layers, losses, metrics, ... the model refers to.
        compile: restore the compile config and the optimizer (``False`` for inference only).
        load: ``load(path, custom_objects=...)`` instead of ``keras.models.load_model`` (the workers pass
            ``hvd.load_model``, whose optimizer comes back distributed with its state).
    """
    import keras

    objects = dict(custom_objects or {})
    with tempfile.TemporaryDirectory(prefix="hvd-keras-") as tmp:
        # a user's checkpoint callback may write legacy HDF5; Keras picks the reader by the suffix
        path = os.path.join(tmp, "model.h5" if data[:4] == b"\x89HDF" else "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        with keras.utils.custom_object_scope(objects):
            if load is not None:
                return load(path, custom_objects=objects)
            return keras.models.load_model(path, custom_objects=objects, compile=compile)
