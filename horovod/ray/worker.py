"""The Ray actor that hosts one Horovod rank (upstream's ``BaseHorovodWorker``).

The driver (:mod:`horovod.ray.runner`) creates one actor per rank, sets the launcher's variables in its
environment (``HOROVOD_RANK``..., the store's address and the job key) and then calls functions in it; the
user's function calls ``hvd.init()`` itself, as under ``horovodrun``.  The actor process lives until the
executor's ``shutdown()``, so Horovod stays initialised between ``run`` calls (a second ``hvd.init()`` is a
no-op), exactly as upstream.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["BaseHorovodWorker"]

# Variables only a launcher may set: dropped from an actor's inherited environment before the driver's go in.
_LAUNCHER_ONLY = ("HOROVOD_ELASTIC", "HOROVOD_ELASTIC_SLOT", "HOROVOD_GLOO_IFACE", "HOROVOD_TLS", "HOROVOD_TLS_CERT",
                  "HOROVOD_TLS_KEY", "HOROVOD_SECRET_KEY")


class BaseHorovodWorker:
    """One rank: upstream's actor API (``execute(f)`` runs ``f(self.executable)``) plus the driver's helpers."""

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        for name in _LAUNCHER_ONLY:
            os.environ.pop(name, None)
        self.world_rank = world_rank
        self.world_size = world_size
        os.environ["HOROVOD_HOSTNAME"] = self.node_id()
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    def __repr__(self) -> str:  # Ray prefixes the actor's output lines with this
        return f"HorovodWorker(rank={self.world_rank})"

    # ------------------------------------------------------------------ upstream's API
    def node_id(self) -> str:
        """The Ray node this actor runs on (ranks are grouped into local ranks by it)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> list[int]:
        """The CUDA devices Ray gave this actor."""
        import ray

        return [int(i) if str(i).isdigit() else i for i in ray.get_gpu_ids()]

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set variables in the actor's process (values as strings)."""
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def start_executable(self, executable_cls: type | None = None, executable_args: list | None = None,
                         executable_kwargs: dict | None = None) -> None:
        """Build ``executable_cls(*args, **kwargs)`` in the actor (after the environment is set)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """``func(self.executable)``."""
        return func(self.executable)

    def set_queue(self, queue: Any) -> None:
        """Where ``horovod.ray.ray_logger.log`` in this actor sends its dicts: the driver's callback queue of
        an elastic job (``None``: a job without callbacks, the dicts are dropped).  Static jobs never call it."""
        from horovod.ray import ray_logger

        self._queue = queue
        ray_logger.configure(queue)

    # ------------------------------------------------------------------ the driver's helpers
    def pid(self) -> int:
        return os.getpid()

    def run_guarded(self, func: Callable[[Any], Any]) -> Any:
        """``execute(func)``; when it raises, this rank leaves the Horovod job and the error names the rank.

        Leaving (``hvd.shutdown()``) makes the other ranks' pending collectives fail at once with
        ``Cause: rank R called shutdown()`` instead of waiting for this rank until a stall deadline.
        """
        try:
            return func(self.executable)
        except BaseException as e:
            self._leave_job()
            note = (f"horovod.ray: raised on rank {self.world_rank} of {self.world_size} "
                    f"(pid {os.getpid()}, host {socket.gethostname()})")
            if not _round_trips(e):  # the driver could not rebuild it: send its text instead
                error = RuntimeError(f"{type(e).__name__}: {e}")
                if hasattr(error, "add_note"):
                    error.add_note(note)
                raise error from None
            if hasattr(e, "add_note"):
                e.add_note(note)
            raise

    def horovod_state(self) -> tuple[int, bool]:
        """(``init()`` attempts so far, initialised now) of this process."""
        from horovod.common import basics

        return basics.generation(), basics.is_initialized()

    def realign(self, generation: int) -> None:
        """After a failed run: leave the job and count ``generation`` ``init()`` attempts, like every rank.

        Ranks that failed before ``hvd.init()`` made fewer attempts than the others; the next ``init()``
        must be the same generation everywhere (see horovod/common/basics.py).
        """
        from horovod.common import basics

        self._leave_job()
        with basics._lock:
            basics._generation = max(basics._generation, generation)

    def leave_job(self) -> None:
        """Leave the Horovod job (the driver's call after this rank's function returned before the others')."""
        self._leave_job()

    @staticmethod
    def _leave_job() -> None:
        """This rank's own ``hvd.shutdown()`` if it is in a job (ends the generation for every rank)."""
        from horovod.common import basics

        if basics.is_initialized():
            try:
                basics.shutdown()
            except Exception:  # noqa: BLE001 - the engine may already be stopped by a peer
                pass


def _round_trips(e: BaseException) -> bool:
    """Whether ``e`` survives pickling (Ray rebuilds the exception on the driver from its pickle)."""
    from ray import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(e))
        return True
    except Exception:  # noqa: BLE001 - any failure to rebuild it
        return False
