"""How estimators' models and parameters travel and persist: base64 cloudpickle inside JSON.

Models and estimators are Spark ML ``MLWritable``/``MLReadable`` (as upstream's): ``obj.save(path)`` (=
``obj.write().save(path)``, ``write().overwrite().save(path)`` to replace ``path``) writes Spark ML's layout,
a directory ``path`` whose ``metadata/part-00000`` is one JSON line ``{"class": <module.Class>, "uid",
"timestamp", "sparkVersion", "paramMap": {name: b64}, "defaultParamMap": {}}`` (through fsspec: local paths and
URLs), so a ``PipelineModel`` holding one saves and loads as any other stage; ``Class.load(path)`` (=
``Class.read().load(path)``) reads it back, also the single JSON file ``{"class", "params"}`` older versions of
this package wrote.  ``backend`` and ``store`` are saved as null (as upstream).  A framework whose model does not
pickle well overrides ``_encode_param`` / ``_decode_param`` for that one parameter.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import cloudpickle
from pyspark.ml.util import MLReader, MLWriter

__all__ = ["dumps_b64", "loads_b64", "save_params", "load_params", "HorovodParamsWriter", "HorovodParamsReader"]

METADATA_FILE = "metadata/part-00000"
"""Where Spark ML's ``DefaultParamsReader.loadMetadata`` (``spark.read.text(<path>/metadata)``) finds the JSON."""

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


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def save_params(path: str, class_name: str, params: dict[str, str], uid: str | None = None,
                overwrite: bool = False) -> None:
    """Write a model's or estimator's encoded parameters in Spark ML's layout (a directory ``path``).

    Raises:
        OSError: ``path`` exists and ``overwrite`` is false (Spark ML's text).
    """
    import pyspark

    fs = _filesystem(path)
    if fs.exists(path):
        if not overwrite:
            raise OSError(f"Path {path} already exists. To overwrite it, please use write().overwrite().save(path).")
        fs.rm(path, recursive=True)
    metadata = {"class": class_name, "timestamp": int(time.time() * 1000), "sparkVersion": pyspark.__version__,
                "uid": uid, "paramMap": params, "defaultParamMap": {}}
    target = _join(path, METADATA_FILE)
    fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(target, "wb") as f:
        f.write(json.dumps(metadata).encode("utf-8") + b"\n")
    with fs.open(_join(path, "metadata/_SUCCESS"), "wb"):
        pass


def load_params(path: str) -> tuple[str, dict[str, str], str | None]:
    """The class name (``module.Class``, or ``Class`` from a single-file save), encoded parameters and uid
    :func:`save_params` wrote at ``path``."""
    fs = _filesystem(path)
    if fs.isfile(path):  # the single JSON file of this package's earlier versions
        with fs.open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
        return data["class"], data["params"], None
    metadata = _join(path, "metadata")
    if fs.isfile(metadata):  # upstream's store.write_text(<path>/metadata, json)
        files = [metadata]
    else:
        files = sorted(f for f in fs.ls(metadata, detail=False) if not f.rsplit("/", 1)[-1].startswith(("_", ".")))
    for name in files:
        with fs.open(name, "rb") as f:
            text = f.read().decode("utf-8").strip()
        if text:
            data = json.loads(text.splitlines()[0])
            return data["class"], data["paramMap"], data.get("uid")
    raise ValueError(f"{path} holds no saved model or estimator (no metadata)")


class HorovodParamsWriter(MLWriter):
    """``instance.write()``: saves ``instance`` (a Horovod Spark model or estimator) with :func:`save_params`."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        pass  # save_params replaces the path itself (through fsspec: no JVM needed)

    def saveImpl(self, path: str) -> None:
        inst = self.instance
        params = {p.name: inst._encode_param(p.name, inst.getOrDefault(p)) for p in inst.params
                  if inst.isDefined(p) and is_saved(p.name)}
        cls = type(inst)
        save_params(path, f"{cls.__module__}.{cls.__qualname__}", params, uid=inst.uid,
                    overwrite=self.shouldOverwrite)


class HorovodParamsReader(MLReader):
    """``Class.read()``: loads what :class:`HorovodParamsWriter` saved (unpickles: only load files you trust)."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        name, params, uid = load_params(path)
        if name.rsplit(".", 1)[-1] != self.cls.__name__:
            raise ValueError(f"{path} holds a {name}, not a {self.cls.__name__}")
        instance = self.cls(**{k: self.cls._decode_param(k, v) for k, v in params.items()})
        if uid:
            instance._resetUid(uid)
        return instance


def is_saved(name: str) -> bool:
    """Whether a parameter is written by ``save`` (backends and stores are not, as upstream)."""
    return name not in _NOT_SAVED
