"""How estimators' models and parameters travel and persist: base64 cloudpickle inside JSON.

How an estimator uses it: ``HorovodModel.save(path)`` writes ``{"class": ..., "params": {name: b64}}`` with
:func:`save_params` (to the model's store if it has one, else to ``path`` through fsspec or the local disk) and
``Class.load(path)`` reads it back with :func:`load_params`; ``backend`` and ``store`` are saved as null (as
upstream).  A framework whose model does not pickle well overrides ``HorovodModel._encode_param`` /
``_decode_param`` for that one parameter.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import cloudpickle

__all__ = ["dumps_b64", "loads_b64", "save_params", "load_params"]

_NOT_SAVED = ("backend", "store")


def dumps_b64(obj: Any) -> str:
    """``obj`` cloudpickled, as base64 text."""
    return base64.b64encode(cloudpickle.dumps(obj)).decode("ascii")


def loads_b64(text: str) -> Any:
    """The object :func:`dumps_b64` encoded (unpickles: only read files you trust)."""
    return cloudpickle.loads(base64.b64decode(text))


def _filesystem(path: str) -> Any:
    from horovod.spark.common.store import _make_filesystem

    return _make_filesystem(path, None)


def save_params(path: str, class_name: str, params: dict[str, str]) -> None:
    """Write the encoded parameters of a model (JSON) to ``path``."""
    fs = _filesystem(path)
    parent = path.rstrip("/").rsplit("/", 1)[0]
    if parent and parent != path:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(json.dumps({"class": class_name, "params": params}).encode("utf-8"))


def load_params(path: str) -> tuple[str, dict[str, str]]:
    """The class name and encoded parameters :func:`save_params` wrote at ``path``."""
    with _filesystem(path).open(path, "rb") as f:
        data = json.loads(f.read().decode("utf-8"))
    return data["class"], data["params"]


def is_saved(name: str) -> bool:
    """Whether a parameter is written by ``save`` (backends and stores are not, as upstream)."""
    return name not in _NOT_SAVED
