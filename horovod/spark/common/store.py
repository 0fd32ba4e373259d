"""Where an estimator keeps its data, checkpoints and logs: upstream's ``Store`` API on fsspec (or a plain path).

How an estimator uses it:

* on the driver, ``prepare_data`` (:mod:`horovod.spark.common.data`) has Spark write the DataFrame as Parquet to
  ``store.get_train_data_path(idx)`` / ``get_val_data_path(idx)`` (URLs Spark can write: :meth:`Store.spark_path`)
  and the column metadata next to it (``get_data_metadata_path``);
* the estimator ships ``store.to_remote(run_id, idx)`` (a picklable :class:`RemoteStore`) to the workers, which
  read their shard of the Parquet files through ``remote.filesystem`` and write checkpoints and logs into a local
  directory that ``remote.sync(local_dir)`` copies into ``runs/<run_id>/`` (rank 0, after each epoch);
* a later ``fit`` with the same ``run_id`` finds ``store.get_checkpoint_path(run_id)`` and resumes from it.

Layout under the prefix (as upstream): ``intermediate_train_data.<idx>/``, ``intermediate_val_data.<idx>/``
(Parquet), ``runs/<run_id>/checkpoint`` and ``runs/<run_id>/logs/``.

Paths, as upstream's: a local prefix (``/p``, ``file:///p``) becomes the URI ``file:///p``, and every path a
store returns for Spark and the workers (``prefix_path``, ``get_{train,val,test}_data_path``, ``get_runs_path``,
``get_run_path``, ``get_checkpoint_path``, ``get_logs_path``) is a full URI (``file:///p/...``, ``s3://b/...``);
``get_localized_path`` strips the scheme, and ``get_data_metadata_path`` and ``get_checkpoints`` return
localized (filesystem) paths.

Any fsspec URL works when fsspec is installed (``s3://``, ``gs://``, ``hdfs://`` with pyarrow's libhdfs ...,
given the filesystem's own package); a plain local or shared (NFS) path works without fsspec.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

__all__ = ["Store", "AbstractFilesystemStore", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore",
           "RemoteStore"]

DEFAULT_CHECKPOINT_FILENAME = "checkpoint"
LOGS_SUBDIR = "logs"


class _LocalFileSystem:
    """The few filesystem calls a store makes, on local paths, for when fsspec is not installed."""

    protocol = ("file", "local")

    def exists(self, path: str) -> bool:
        return os.path.exists(_local_path(path))

    def open(self, path: str, mode: str = "rb") -> Any:
        return open(_local_path(path), mode)

    def makedirs(self, path: str, exist_ok: bool = True) -> None:
        os.makedirs(_local_path(path), exist_ok=exist_ok)

    def rm(self, path: str, recursive: bool = False) -> None:
        path = _local_path(path)
        if os.path.isdir(path):
            shutil.rmtree(path) if recursive else os.rmdir(path)
        else:
            os.remove(path)

    def find(self, path: str) -> list[str]:
        found = []
        for root, _dirs, files in os.walk(_local_path(path)):
            found.extend(os.path.join(root, f) for f in files)
        return sorted(found)

    def put(self, local: str, remote: str, recursive: bool = False) -> None:
        if os.path.isdir(local):
            shutil.copytree(local, remote, dirs_exist_ok=True)
        else:
            shutil.copy2(local, remote)


def _is_local(prefix: str) -> bool:
    scheme = urlparse(prefix).scheme
    return scheme in ("", "file", "local") or (len(scheme) == 1 and os.name == "nt")


def _local_path(prefix: str) -> str:
    return urlparse(prefix).path if prefix.startswith(("file:", "local:")) else prefix


def _local_uri(path: str) -> str:
    """A local path (or ``file:``/``local:`` URL) as an absolute ``file:///`` URI (upstream's full path)."""
    return pathlib.Path(os.path.abspath(_local_path(path))).as_uri()


def _make_filesystem(prefix: str, storage_options: dict[str, Any] | None) -> Any:
    try:
        import fsspec
    except ImportError:
        if not _is_local(prefix):
            raise ImportError(f"Store {prefix!r}: a non-local store needs fsspec (pip install fsspec, plus the "
                              f"filesystem's package, e.g. s3fs for s3://)") from None
        return _LocalFileSystem()
    if _is_local(prefix):
        return fsspec.filesystem("file")
    fs, _ = fsspec.core.url_to_fs(prefix, **(storage_options or {}))
    return fs


class Store:
    """Upstream's base store: the paths of an estimator's intermediate data, runs, checkpoints and logs.

    ``Store.create(prefix)`` picks the implementation from the prefix (``hdfs://`` -> :class:`HDFSStore`,
    Databricks' ``dbfs:/`` or ``/dbfs/`` under ``DATABRICKS_RUNTIME_VERSION`` -> :class:`DBFSLocalStore`, anything
    else -> :class:`FilesystemStore`).
    """

    def __init__(self, prefix_path: str, train_path: str | None = None, val_path: str | None = None,
                 test_path: str | None = None, runs_path: str | None = None, save_runs: bool = True,
                 storage_options: dict[str, Any] | None = None, checkpoint_filename: str | None = None) -> None:
        if not prefix_path:
            raise ValueError("Store: prefix_path must be a non-empty path or URL")
        self.prefix_path = self._normalize(prefix_path)
        self._train_path = self._normalize(train_path) if train_path else self._join("intermediate_train_data")
        self._val_path = self._normalize(val_path) if val_path else self._join("intermediate_val_data")
        self._test_path = self._normalize(test_path) if test_path else self._join("intermediate_test_data")
        self._runs_path = self._normalize(runs_path) if runs_path else self._join("runs")
        self._save_runs = save_runs
        self.storage_options = dict(storage_options or {})
        self._checkpoint_filename = checkpoint_filename or DEFAULT_CHECKPOINT_FILENAME
        self._fs: Any = None

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> Store:
        """The store for ``prefix_path`` (see the class docstring)."""
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if DBFSLocalStore.matches(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    # --- paths ---------------------------------------------------------------------------------------------

    def _normalize(self, path: str) -> str:
        path = str(path)
        return _local_uri(path) if _is_local(path) else path.rstrip("/")

    def _join(self, *parts: str) -> str:
        return "/".join([self.prefix_path.rstrip("/"), *parts])

    @staticmethod
    def _indexed(base: str, idx: int | None) -> str:
        return base if idx is None else f"{base}.{idx}"

    def get_train_data_path(self, idx: int | None = None) -> str:
        return self._indexed(self._train_path, idx)

    def get_val_data_path(self, idx: int | None = None) -> str:
        return self._indexed(self._val_path, idx)

    def get_test_data_path(self, idx: int | None = None) -> str:
        return self._indexed(self._test_path, idx)

    def get_data_metadata_path(self, path: str) -> str:
        """Where ``prepare_data`` keeps the metadata of the Parquet dataset at ``path``: beside it, a localized
        path named ``<path>_<host hash>_cached_metadata.pkl`` (upstream's name; the content is ours: JSON)."""
        from horovod.spark.task import host_hash

        return f"{self._fs_path(path).rstrip('/')}_{host_hash()}_cached_metadata.pkl"

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return f"{self._runs_path}/{run_id}"

    def get_checkpoint_filename(self) -> str:
        return self._checkpoint_filename

    def get_logs_subdir(self) -> str:
        return LOGS_SUBDIR

    def get_checkpoint_path(self, run_id: str) -> str | None:
        return f"{self.get_run_path(run_id)}/{self._checkpoint_filename}" if self._save_runs else None

    def get_logs_path(self, run_id: str) -> str | None:
        return f"{self.get_run_path(run_id)}/{LOGS_SUBDIR}" if self._save_runs else None

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> list[str]:
        """The files under the run's path ending in ``suffix``, sorted."""
        run_path = self.get_run_path(run_id)
        if not self.exists(run_path):
            return []
        return sorted(p for p in self.filesystem.find(self._fs_path(run_path)) if p.endswith(suffix))

    def spark_path(self, path: str) -> str:
        """``path`` as Spark's writers and readers take it (a local path becomes a ``file://`` URL)."""
        return _local_uri(path) if _is_local(path) else path

    # --- file access -----------------------------------------------------------------------------------------

    @property
    def filesystem(self) -> Any:
        """The fsspec filesystem of the prefix (a minimal local one without fsspec); pyarrow reads through it."""
        if self._fs is None:
            self._fs = _make_filesystem(self.prefix_path, self.storage_options)
        return self._fs

    def _fs_path(self, path: str) -> str:
        return _local_path(path) if _is_local(path) else self.filesystem._strip_protocol(path)

    def exists(self, path: str) -> bool:
        return bool(self.filesystem.exists(self._fs_path(path)))

    def read(self, path: str) -> bytes:
        with self.filesystem.open(self._fs_path(path), "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        parent = path.rstrip("/").rsplit("/", 1)[0]
        self.filesystem.makedirs(self._fs_path(parent), exist_ok=True)
        with self.filesystem.open(self._fs_path(path), "wb") as f:
            f.write(data)

    def read_text(self, path: str) -> str:
        return self.read(path).decode("utf-8")

    def write_text(self, path: str, text: str) -> None:
        self.write(path, text.encode("utf-8"))

    def delete(self, path: str) -> None:
        """Remove ``path`` (a directory with its contents); nothing if it does not exist."""
        if self.exists(path):
            self.filesystem.rm(self._fs_path(path), recursive=True)

    def list_files(self, path: str, suffix: str = "") -> list[str]:
        """Every file below ``path`` whose name ends in ``suffix``, sorted (filesystem paths, no scheme)."""
        if not self.exists(path):
            return []
        return sorted(p for p in self.filesystem.find(self._fs_path(path)) if p.endswith(suffix))

    def is_parquet_dataset(self, path: str) -> bool:
        return bool(self.list_files(path, ".parquet"))

    def get_parquet_dataset(self, path: str) -> Any:
        import pyarrow.parquet as pq

        return pq.ParquetDataset(self.list_files(path, ".parquet"), filesystem=self.filesystem)

    # --- runs --------------------------------------------------------------------------------------------------

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """A context manager factory: a fresh local directory for a worker's checkpoints and logs."""
        @contextlib.contextmanager
        def local_run_path() -> Iterator[str]:
            path = tempfile.mkdtemp(prefix=f"horovod_{run_id}_")
            try:
                yield path
            finally:
                shutil.rmtree(path, ignore_errors=True)

        return local_run_path

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """``fn(local_dir)`` copying the directory's contents into the run's path (files overwritten)."""
        run_path = self.get_run_path(run_id)

        def sync(local_dir: str) -> None:
            for root, _dirs, files in os.walk(local_dir):
                for name in files:
                    local = os.path.join(root, name)
                    rel = os.path.relpath(local, local_dir).replace(os.sep, "/")
                    with open(local, "rb") as f:
                        self.write(f"{run_path}/{rel}", f.read())

        return sync

    def to_remote(self, run_id: str, dataset_idx: int | None = None) -> RemoteStore:
        """What the workers need of this store, picklable."""
        return RemoteStore(store=self, run_id=run_id, train_data_path=self.get_train_data_path(dataset_idx),
                           val_data_path=self.get_val_data_path(dataset_idx),
                           test_data_path=self.get_test_data_path(dataset_idx), saving_runs=self._save_runs,
                           runs_path=self._runs_path, run_path=self.get_run_path(run_id),
                           checkpoint_path=self.get_checkpoint_path(run_id), logs_path=self.get_logs_path(run_id),
                           checkpoint_filename=self._checkpoint_filename, logs_subdir=LOGS_SUBDIR)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"] = None  # made again where it is used (filesystem clients hold sockets and threads)
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class AbstractFilesystemStore(Store):
    """Upstream's base of the stores on a filesystem: full (URI) and localized paths, the filesystem object."""

    def get_full_path(self, path: str) -> str:
        """``path`` as a full URI (a local path -> ``file:///abs/path``; a URI as it is)."""
        return self._normalize(path)

    def get_full_path_fn(self) -> Callable[[str], str]:
        return self.get_full_path

    def get_localized_path(self, path: str) -> str:
        """``path`` without its scheme (and host), as the filesystem object takes it."""
        return self._fs_path(path)

    @property
    def fs(self) -> Any:
        return self.filesystem

    def get_filesystem(self) -> Any:
        return self.filesystem


class FilesystemStore(AbstractFilesystemStore):
    """A store on any fsspec filesystem (``s3://``, ``gs://``, ``abfs://``, ``file://``, a local path ...).

    ``storage_options`` go to the fsspec filesystem (credentials, endpoints).
    """


class LocalStore(FilesystemStore):
    """Upstream's name for a store on a local or shared (NFS) path every executor sees at the same place."""


class HDFSStore(FilesystemStore):
    """A store on HDFS through fsspec and pyarrow's libhdfs (``hdfs://namenode:port/path``, ``hdfs:///path``).

    Needs fsspec, pyarrow and a Hadoop client (``HADOOP_HOME``, ``CLASSPATH``) on the driver and the executors;
    without them the first access raises the filesystem's error naming what is missing.
    """

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None, user: str | None = None,
                 kerb_ticket: str | None = None, driver: str = "libhdfs", extra_conf: dict[str, str] | None = None,
                 *args: Any, **kwargs: Any) -> None:
        url = urlparse(prefix_path)
        if url.scheme not in ("", "hdfs") or not url.path:
            raise ValueError(f"HDFSStore: {prefix_path!r} is not an hdfs://host:port/path, hdfs:///path or /path URL")
        self._host = host or url.hostname or "default"
        self._port = port or url.port or 0
        options = dict(kwargs.pop("storage_options", None) or {})
        options.update({"host": self._host, "port": self._port})
        if user:
            options["user"] = user
        if kerb_ticket:
            options["kerb_ticket"] = kerb_ticket
        if extra_conf:
            options["extra_conf"] = extra_conf
        netloc = self._host if self._host == "default" else f"{self._host}:{self._port}"
        super().__init__(f"hdfs://{netloc}{url.path}", *args, storage_options=options, **kwargs)

    @staticmethod
    def matches(prefix_path: str) -> bool:
        return urlparse(prefix_path).scheme == "hdfs"


class DBFSLocalStore(FilesystemStore):
    """Databricks' DBFS through its local mount (``dbfs:/p``, ``/dbfs/p``, ``file:/dbfs/p`` -> ``/dbfs/p``)."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(self.normalize_datababricks_path(prefix_path), *args, **kwargs)

    @staticmethod
    def matches(prefix_path: str) -> bool:
        return bool(os.environ.get("DATABRICKS_RUNTIME_VERSION")) and not prefix_path.startswith("dbfs://") and (
            prefix_path.startswith(("dbfs:/", "/dbfs/", "file:///dbfs/", "file:/dbfs/")))

    @staticmethod
    def normalize_datababricks_path(path: str) -> str:
        for prefix in ("dbfs:/", "file:///dbfs/", "file:/dbfs/"):
            if path.startswith(prefix):
                return "/dbfs/" + path[len(prefix):].lstrip("/")
        if not path.startswith("/dbfs/"):
            raise ValueError(f"DBFSLocalStore: {path!r} is not a dbfs:/ or /dbfs/ path")
        return path


@dataclass
class RemoteStore:
    """The store as the workers see it (upstream's ``to_remote``): its paths for one run and dataset."""

    store: Store
    run_id: str
    train_data_path: str
    val_data_path: str
    test_data_path: str
    saving_runs: bool
    runs_path: str
    run_path: str
    checkpoint_path: str | None
    logs_path: str | None
    checkpoint_filename: str
    logs_subdir: str

    @property
    def filesystem(self) -> Any:
        return self.store.filesystem

    def get_local_output_dir(self) -> contextlib.AbstractContextManager[str]:
        return self.store.get_local_output_dir_fn(self.run_id)()

    def sync(self, local_dir: str) -> None:
        self.store.sync_fn(self.run_id)(local_dir)
