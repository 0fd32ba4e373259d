"""Elastic rank assignment: what ``basics.init()`` does first when ``HOROVOD_ELASTIC=1``.

The elastic driver (``horovod.runner.elastic.driver``) numbers its rank assignments by *generation* and
publishes them in the rendezvous store (docs/elastic.md has the whole protocol):

=====================================  ===========================================================
``elastic/generation``                 ``"<g> <hosts_ts> <fresh>"``: the current generation, the newest
                                       host-update notice its assignment already reflects, and 1 if
                                       it started a worker (one that has none of the job's state)
``elastic/assign.<g>/<slot>``          ``"rank,size,local_rank,local_size,cross_rank,cross_size"``
                                       (rank ``-1``: the slot is not part of generation g)
``elastic/reset.<g>``                  present once the driver has decided that generation g is over
``elastic/ready.<g>/<slot>``           written by a worker that left generation g (failed collective,
                                       host-update interrupt, or a mesh that could not be built)
``elastic/alive.<g>/<slot>``           a counter the worker that joined generation g bumps every
                                       :func:`heartbeat_period` from a thread of its own: after a failure,
                                       the driver waits for a worker that is busy (a checkpoint, a
                                       validation pass) and kills one whose heartbeat stopped (hung)
=====================================  ===========================================================

A slot is ``<host>:<local_rank>`` as the driver started the worker (``HOROVOD_ELASTIC_SLOT``).  A worker
joins the current generation on its first ``init()`` and, on every later ``init()``, announces that it left
the one it used and waits for a newer one.  It then sets ``HOROVOD_RANK`` ... from its assignment and builds
the mesh in the scope ``elastic.<g>``; if the generation ends meanwhile (a peer died before the mesh was
complete) it leaves and waits for the next one instead of failing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from horovod.base import auth
from horovod.base.config import is_set, read_env, start_timeout

__all__ = ["rendezvous", "hosts_baseline", "current_generation", "slot_name", "REMOVED_MESSAGE"]

logger = logging.getLogger(__name__)

REMOVED_MESSAGE = "{host}[{local_rank}] has been removed from elastic job"
"""Upstream's error when a re-initialising worker's slot is no longer part of the job."""

GENERATION_KEY = "elastic/generation"


def heartbeat_period(grace: float) -> float:
    """How often a worker bumps ``elastic/alive.<g>/<slot>``: a quarter of ``HOROVOD_ELASTIC_GRACE_SECONDS``
    (the silence after which the driver takes it for hung), within [0.5, 5] s -- one signed request per
    worker and period, so a large job does not load the driver's store for nothing."""
    return min(5.0, max(0.5, grace / 4))


_POLL = 0.1

_last_generation: int | None = None
_hosts_baseline: float = 0.0
_newcomers: bool = False
_heartbeat: threading.Thread | None = None
_heartbeat_target: tuple[str, int, bytes, str] | None = None


class _GenerationEnded(Exception):
    """The driver ended the generation this worker was joining."""


def launched_by_driver(environ=None) -> bool:
    """The elastic driver (horovod.runner.elastic.driver) started this process: it sets
    ``HOROVOD_ELASTIC_SLOT`` (with ``HOROVOD_ELASTIC=1``) and a rendezvous address.  ``HOROVOD_ELASTIC=1``
    alone is only the user's knob, which a static ``horovodrun`` passes on to its workers (and torchrun to
    its own): such a worker takes its rank from its launcher, as upstream's first ``init()`` does."""
    return (bool(read_env("HOROVOD_ELASTIC", environ)) and is_set("HOROVOD_ELASTIC_SLOT", environ)
            and bool(read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR", environ)))


def slot_name() -> str:
    """This worker's slot as the driver started it (``host:local_rank``)."""
    slot = read_env("HOROVOD_ELASTIC_SLOT")
    if slot:
        return slot
    return f"{read_env('HOROVOD_HOSTNAME') or 'localhost'}:{read_env('HOROVOD_LOCAL_RANK')}"


def hosts_baseline() -> float:
    """Timestamp of the newest host-update notice that this worker's assignment already includes."""
    return _hosts_baseline


def newcomers() -> bool:
    """Whether the world this worker joined in its last ``init()`` may hold a worker without the job's
    state: the driver started one for that generation, or this worker skipped a generation (whose mesh
    failed), in which a worker may have been started that never synchronised.  A reset after a removal
    must then ``sync()`` all the same (the new worker does, on its first call)."""
    return _newcomers


def current_generation() -> int | None:
    """The generation this process last joined (None before the first elastic ``init``)."""
    return _last_generation


def _read_generation(store: Any) -> tuple[int, float, bool] | None:
    from horovod.transport.store import StoreError

    try:
        text = store.get(GENERATION_KEY, timeout=0).decode()
    except StoreError as e:
        if str(e).startswith("timed out waiting"):
            return None
        raise
    g, ts, fresh = (text.split() + ["0", "0"])[:3]
    return int(g), float(ts), fresh == "1"


def _wait_generation(store: Any, after: int | None, deadline: float) -> tuple[int, float, bool]:
    while True:
        found = _read_generation(store)
        if found is not None and (after is None or found[0] > after):
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"Timed out waiting for the elastic driver to assign a rank to {slot_name()} "
                               "(HOROVOD_ELASTIC_TIMEOUT); is the driver still running?")
        time.sleep(_POLL)


def _leave(store: Any, generation: int, why: str) -> None:
    try:
        store.put(f"elastic/ready.{generation}/{slot_name()}", why.encode()[:1000])
    except Exception as e:  # noqa: BLE001 - the driver also notices through our exit or its grace deadline
        logger.warning("elastic: could not report leaving generation %d: %s", generation, e)


def _removed_between(store: Any, slot: str, after: int, generation: int) -> bool:
    """Whether a generation this worker skipped (``after`` < g < ``generation``) assigned its slot rank -1.
    The driver never gives a removed worker a slot again: when the host comes back, the slot's assignment
    is for the fresh worker started for it, not for this one (which would join as that worker's twin)."""
    for g in range(after + 1, generation):
        key = f"elastic/assign.{g}/{slot}"
        if store.exists(key) and int(store.get(key, timeout=10.0).split(b",")[0]) < 0:
            return True
    return False


class _AbortableStore:
    """The store as ``build_mesh`` sees it: waits end early when the driver ends the generation.

    ``check`` is ``build_mesh``'s ``abort``: it also ends the waits for peers' connections, which a peer
    killed mid-formation would otherwise hold until the start timeout -- longer than the driver's grace
    for leaving a generation, after which it kills the waiting survivor too.
    """

    def __init__(self, store: Any, generation: int) -> None:
        self._store = store
        self._reset_key = f"elastic/reset.{generation}"
        self.addr = getattr(store, "addr", None)
        self._checked = 0.0

    def check(self) -> None:
        """Raise :class:`_GenerationEnded` if the driver ended the generation (asks it at most every 0.2 s)."""
        now = time.monotonic()
        if now - self._checked < 0.2:
            return
        self._checked = now
        if self._store.exists(self._reset_key):
            generation = self._reset_key.rpartition(".")[2]
            raise _GenerationEnded(f"the elastic driver ended generation {generation} ({self._reset_key}: a "
                                   "worker failed or left while the mesh formed)")

    def put(self, key: str, value: bytes) -> None:
        self._store.put(key, value)

    def delete(self, key: str) -> None:
        self._store.delete(key)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        from horovod.transport.store import StoreError

        deadline = time.monotonic() + (30.0 if timeout is None else timeout)
        while True:
            try:
                return self._store.get(key, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except StoreError:
                if time.monotonic() >= deadline:
                    raise
            self.check()


def _start_heartbeat(addr: str, port: int, key: bytes, slot: str) -> None:
    """Bump ``elastic/alive.<g>/<slot>`` every :func:`heartbeat_period` (g: the generation last joined) for as
    long as the process lives, whatever its main thread does: the driver tells a busy worker from a hung one
    (SIGSTOPped, or stuck in native code that holds the GIL) by it.  The target is the latest job's store (a
    process that runs several jobs, such as a Ray actor, beats for the current one)."""
    global _heartbeat, _heartbeat_target
    _heartbeat_target = (addr, int(port), key, slot)
    if _heartbeat is not None and _heartbeat.is_alive():
        return
    from horovod.transport.store import StoreClient

    period = heartbeat_period(read_env("HOROVOD_ELASTIC_GRACE_SECONDS"))

    def beat() -> None:
        count, target, store = 0, None, None
        while True:
            generation = _last_generation
            if generation is not None:
                if _heartbeat_target != target:
                    target = _heartbeat_target
                    store = StoreClient(*target[:3], timeout=min(5.0, 2 * period + 1))
                count += 1
                try:
                    store.put(f"elastic/alive.{generation}/{target[3]}", str(count).encode())
                except Exception:  # noqa: BLE001 - the driver is gone or busy: the next beat tries again
                    pass
            time.sleep(period)

    _heartbeat = threading.Thread(target=beat, name="horovod-elastic-heartbeat", daemon=True)
    _heartbeat.start()


def rendezvous() -> Any:
    """Get this worker's rank from the driver, export it as ``HOROVOD_RANK`` ..., and build the mesh.

    Returns:
        The :class:`horovod.transport.mesh.Mesh` for a world larger than one, else None.

    Raises:
        RuntimeError: this worker's slot was removed from the job (upstream's text), or no assignment came
            within ``HOROVOD_ELASTIC_TIMEOUT`` seconds.
    """
    global _last_generation, _hosts_baseline, _newcomers
    from horovod.transport import build_mesh
    from horovod.transport.store import StoreClient

    addr = read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = read_env("HOROVOD_GLOO_RENDEZVOUS_PORT")
    key = auth.secret_key_from_env()
    if not addr or port is None or key is None:
        raise ValueError("Horovod elastic initialization failed: no rendezvous address or job key in the "
                         "environment. Start the job with horovodrun.")
    store = StoreClient(addr, port, key, timeout=10.0)
    # The driver's own deadline for slots starts once every worker left the generation, which a busy one (its
    # heartbeat still going) may take up to HOROVOD_ELASTIC_TIMEOUT to do, a hung one the grace period: give it
    # that long and more, so that the driver (which knows why: too few slots) ends the job, not this worker
    # with a "is the driver still running?" that blamed the driver.
    elastic_timeout = read_env("HOROVOD_ELASTIC_TIMEOUT")
    deadline = time.monotonic() + 2 * elastic_timeout + read_env("HOROVOD_ELASTIC_GRACE_SECONDS") + 10
    mesh_timeout = start_timeout()
    slot = slot_name()
    host, _, local_rank = slot.rpartition(":")
    _start_heartbeat(addr, port, key, slot)
    left = _last_generation
    if _last_generation is not None:
        _leave(store, _last_generation, "re-initialising")
    while True:
        previous = _last_generation
        generation, hosts_ts, fresh = _wait_generation(store, _last_generation, deadline)
        _last_generation = generation
        if previous is not None and _removed_between(store, slot, previous, generation):
            raise RuntimeError(REMOVED_MESSAGE.format(host=host, local_rank=local_rank))
        if store.exists(f"elastic/reset.{generation}"):
            _leave(store, generation, "joined a generation that was already ending")
            continue
        fields = [int(x) for x in store.get(f"elastic/assign.{generation}/{slot}", timeout=30.0).split(b",")]
        rank, size, lrank, lsize, crank, csize = fields
        if rank < 0:
            raise RuntimeError(REMOVED_MESSAGE.format(host=host, local_rank=local_rank))
        os.environ.update({
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(lrank),
            "HOROVOD_LOCAL_SIZE": str(lsize), "HOROVOD_CROSS_RANK": str(crank), "HOROVOD_CROSS_SIZE": str(csize),
            "HOROVOD_HOSTNAME": host,
        })
        logger.info("elastic: %s is rank %d of %d in generation %d", slot, rank, size, generation)
        _newcomers = fresh or left is None or generation != left + 1
        if size == 1:
            _hosts_baseline = hosts_ts
            return None
        try:
            abortable = _AbortableStore(store, generation)
            mesh = build_mesh(rank, size, host, abortable, key, scope=f"elastic.{generation}",
                              timeout=mesh_timeout, abort=abortable.check)
        except Exception as e:  # noqa: BLE001 - a peer vanished while we met: leave, wait for the next round
            logger.warning("elastic: could not build the mesh of generation %d: %s", generation, e)
            _leave(store, generation, f"mesh failed: {e}")
            continue
        _hosts_baseline = hosts_ts
        return mesh
