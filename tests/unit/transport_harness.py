"""Multi-process harness for the transport tests: a file-based store and an N-rank runner.

``run_ranks(n, fn, ...)`` spawns ``n`` processes ("spawn" context); each builds a mesh through a
:class:`FileStore` in a fresh directory and calls ``fn(ctx)``.  Results (or tracebacks) come back through a
queue; the first failure or the hard timeout kills every rank, so a broken collective cannot hang the suite.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

KEY = b"k" * 32
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FileStore:
    """put/get/delete over files in a directory shared by the test's processes."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "__"))

    def put(self, key: str, value: bytes) -> None:
        tmp = self._path(key) + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, self._path(key))

    def get(self, key: str, timeout: float | None = 30.0) -> bytes:
        deadline = time.monotonic() + (30.0 if timeout is None else timeout)
        while True:
            try:
                with open(self._path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no key {key!r}") from None
                time.sleep(0.002)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass


@dataclasses.dataclass
class Ctx:
    rank: int
    size: int
    store: FileStore
    mesh: Any
    config: Any
    args: Any


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname}:{record.name}:{record.getMessage()}")


def _child(rank: int, size: int, root: str, fn: Callable[[Ctx], Any], args: Any, hosts: list[str] | None,
           disable_shm: bool, op_timeout: float, before_mesh: Callable[[int, FileStore], None] | None,
           results: Any) -> None:
    import sys

    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)
    from horovod.base.config import RuntimeConfig
    from horovod.transport.mesh import build_mesh

    handler = _ListHandler()
    logging.getLogger("horovod").addHandler(handler)
    logging.getLogger("horovod").setLevel(logging.DEBUG)
    store = FileStore(root)
    try:
        if before_mesh is not None:
            before_mesh(rank, store)
        hostname = hosts[rank] if hosts else "localhost"
        mesh = build_mesh(rank, size, hostname, store, KEY, scope="t", timeout=20.0, disable_shm=disable_shm)
        config = RuntimeConfig(op_timeout=op_timeout, disable_shm=disable_shm)
        out = fn(Ctx(rank, size, store, mesh, config, args))
        results.put((rank, "ok", out, handler.records))
        mesh.close()
    except BaseException:
        results.put((rank, "error", traceback.format_exc(), handler.records))


def run_ranks(size: int, fn: Callable[[Ctx], Any], args: Any = None, *, timeout: float = 60.0,
              hosts: list[str] | None = None, disable_shm: bool = False, op_timeout: float = 30.0,
              before_mesh: Callable[[int, FileStore], None] | None = None,
              expect_fail: set[int] | None = None,
              during: Callable[[list[Any], FileStore], None] | None = None) -> dict[int, Any]:
    """Run ``fn`` on ``size`` ranks; return ``{rank: (status, value, log_lines)}``.

    Ranks in ``expect_fail`` may die or error (their result is ``("dead", None, [])`` when missing); any
    other error fails the test with the rank's traceback.  ``during(procs, store)`` runs in the parent
    while the ranks work (e.g. to kill one or to attack the listeners).
    """
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    expect_fail = expect_fail or set()
    with tempfile.TemporaryDirectory(prefix="hvd-transport-") as root:
        procs = [ctx.Process(target=_child, args=(r, size, root, fn, args, hosts, disable_shm, op_timeout,
                                                  before_mesh, results), daemon=True)
                 for r in range(size)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        try:
            if during is not None:
                during(procs, FileStore(root))
            deadline = time.monotonic() + timeout
            alive = set(range(size))
            while alive - got.keys():
                try:
                    rank, status, value, logs = results.get(timeout=0.1)
                except queue.Empty:
                    for r in list(alive):
                        if not procs[r].is_alive() and r not in got:
                            # A dead rank may still have a result in flight; give it a moment.
                            try:
                                rank, status, value, logs = results.get(timeout=0.5)
                            except queue.Empty:
                                if r in expect_fail:
                                    alive.discard(r)
                                    got[r] = ("dead", None, [])
                                    break
                                raise AssertionError(f"rank {r} died (exit {procs[r].exitcode})") from None
                            got[rank] = (status, value, logs)
                            break
                    if time.monotonic() > deadline:
                        raise AssertionError(f"timed out after {timeout} s; finished: {sorted(got)}") from None
                    continue
                got[rank] = (status, value, logs)
                if status == "error" and rank not in expect_fail:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        return got
