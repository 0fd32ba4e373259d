"""init/shutdown/rank/size and friends, shared by every framework adapter.

One engine per process, whichever frameworks are imported: ``horovod.torch.init()`` and
``horovod.tensorflow.init()`` in the same process start it once.  The rank layout comes from the launcher's
environment (``HOROVOD_RANK``, ... see docs/architecture.md); with none set, the process runs alone.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from horovod.base.config import read_runtime_config, unknown_variables
from horovod.base.reduce_ops import ReduceOp
from horovod.common import bootstrap, heap, logconfig, naming
from horovod.runtime.engine import Engine, Topology, check_output_files, engine_core
from horovod.runtime.messages import Request, RequestType
from horovod.runtime.validation import process_set_ranks_error

__all__ = [
    "HorovodBasics", "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "sycl_built",
    "start_timeline", "stop_timeline", "show_in_timeline_as", "engine", "process_set_ranks", "Average", "Sum",
    "Adasum", "Min", "Max", "Product",
]

if TYPE_CHECKING:  # process_sets imports this module (ProcessSet.rank() asks it): no import back
    from horovod.common.process_sets import ProcessSet

log = logging.getLogger(__name__)

# Upstream's public constants (hvd.Average ...): the members of the one ReduceOp definition.
Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN,
                                          ReduceOp.MAX, ReduceOp.PRODUCT)

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

_lock = threading.RLock()
_engine: Engine | None = None
_timeline_rows: dict[str, tuple[str, ...]] = {}  # show_in_timeline_as(): engine name -> timeline rows
_static_sets: list[ProcessSet] = []
_dynamic_counter = 0
# Upstream's flag: True from a successful init() until this process calls shutdown().  A shutdown started by
# another rank stops the engine (operations then fail with ShutdownError) but leaves the flag set, so init()
# stays a no-op until this rank's own shutdown(): every rank starts a new generation only through its own
# shutdown()/init() pair, never because a peer's shutdown happened to arrive first.
_initialized = False
# init() attempts so far (failed ones too): attempt g meets the other ranks in the store scope ``init.<g>``,
# so ranks that call init()/shutdown() equally often agree on the generation; bootstrap names any mismatch.
_generation = 0
_atexit_registered = False
_mpi = None  # horovod.transport.mpi.MpiJob while running under MPI
_global_comm = None  # the mpi4py communicator given to init(comm=...) under MPI (global_process_set.mpi_comm)


def init(comm=None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Start Horovod in this process.

    A no-op until this process calls shutdown(), also when another rank's shutdown (or failure) already
    stopped the engine, as upstream; after shutdown() it starts a new generation of the job, which every
    rank must join with its own shutdown()/init() (a rank that does not is named in the error).
    """
    global _engine, _static_sets, _dynamic_counter, _initialized, _generation, _atexit_registered, _mpi
    global _global_comm
    with _lock:
        if _initialized:  # upstream: the engine is not touched; the objects passed are matched to its sets
            if process_sets is not None and not isinstance(process_sets, str):
                _match_static_sets(list(process_sets), _engine.set_table(), _mpi)
            return
        bootstrap.refuse_a_copy_of_a_rank()
        _generation += 1
        gen = _generation
        config = read_runtime_config()
        if isinstance(process_sets, str):
            if process_sets.lower() != "dynamic":
                raise ValueError(f"Unknown process_sets value: {process_sets!r}")
            config = dataclasses.replace(config, dynamic_process_sets=True)  # this init only
            process_sets = None
        bootstrap.join_torchrun(comm)  # torchrun/PyTorchJob: exports HOROVOD_RANK... (a no-op otherwise)
        bootstrap.join_without_mpi(comm)  # srun, or one-host mpirun, without MPI: the same
        elastic_mesh = bootstrap.elastic_mesh()  # elastic: the driver assigns the rank (sets HOROVOD_RANK...)
        mpi = bootstrap.mpi_job(comm) if bootstrap.use_mpi(comm) else None
        topology = bootstrap.topology_from_mpi(mpi) if mpi is not None else bootstrap.topology_from_env()
        logconfig.configure(config.log_level, config.log_hide_time, topology.rank)
        if config.retain_heap:  # opt-in (horovod/common/heap.py)
            heap.retain_heap()
        if gen == 1 and topology.rank == 0:  # once per job: every rank has the same environment
            for warning in unknown_variables():
                log.warning(warning)
        mesh = elastic_mesh
        try:
            core = engine_core(config, topology)  # before meeting the others: bad settings fail on their own
            check_output_files(config, topology.rank)
            sets = list(process_sets or [])
            table = _static_set_table(sets, mpi, topology.size)
            if topology.size > 1 and mesh is None:
                mesh = bootstrap.build_mesh(topology, table, gen, mpi)
            engine = Engine(topology, config, mesh, {i + 1: ranks for i, ranks in enumerate(table)}, core)
        except Exception:
            if mesh is not None:
                mesh.close()
            if mpi is not None:
                mpi.close()
            raise
        if engine.timeline is not None:
            for name, members in _timeline_rows.items():
                engine.timeline.show_as(name, members)
        engine.start()
        bootstrap.claim_rank()
        _engine = engine
        _mpi = mpi
        _static_sets = sets
        _dynamic_counter = 0
        _initialized = True
        _global_comm = comm if mpi is not None and hasattr(comm, "Get_group") else None  # global_process_set's
        naming.reset()
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            sys.excepthook = _recording_excepthook(sys.excepthook)
            _atexit_registered = True
        # As upstream: a process set listed twice (the same ranks, or this rank's communicator matching another
        # entry's) fails init() *after* the job started, so ranks whose lists differ only there (the even ranks'
        # communicator is also a list of ranks on the even ranks only) do not hang each other; call init()
        # again with a list without duplicates to get the objects registered.
        _match_static_sets(sets, engine.set_table(), mpi)


def _orphan_engine_in_forked_child() -> None:
    """``os.fork()`` in a rank (DataLoader workers): the child's engine has none of the threads that run it."""
    engine = _engine
    if engine is not None:
        engine.orphan_after_fork(os.getppid())


os.register_at_fork(after_in_child=_orphan_engine_in_forked_child)


def generation() -> int:
    """How many times this process has tried to init() (the job generation it is, or was last, part of)."""
    return _generation


def participation_epoch() -> tuple[int, int]:
    """(generation, joins completed): changes, at the same point on every rank, whenever the ranks taking part
    in reductions may have changed (a new generation of the job, or the end of a ``join()`` during which
    joined ranks only added zeros).  A check done once "per epoch" is then done by every rank or by none."""
    return _generation, engine().executor.joins_completed


def _comm_ranks(comm, mpi) -> list[int] | None:
    """The job ranks of an mpi4py communicator's processes, sorted (None for ``MPI.COMM_NULL``: this rank took
    ``MPI.UNDEFINED`` in the ``Split``).  Local: no communication."""
    from mpi4py import MPI

    if comm == MPI.COMM_NULL:
        return None
    job_group = mpi.comm.Get_group()
    group = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), job_group)
    finally:
        group.Free()
        job_group.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError(f"Horovod could not be initialized: the communicator {comm} has processes that are not "
                         "part of the Horovod job.")
    return sorted(ranks)


def _static_set_table(sets: list[ProcessSet], mpi, world_size: int) -> list[list[int]]:
    """The static process sets of the job, ids 1, 2, ... in this order, as upstream's core registers them:
    first every distinct group of each entry made from an mpi4py communicator (``hvd.ProcessSet(comm.Split(...))``:
    each rank holds its own group, so the groups of all ranks are gathered; in order of their lowest rank),
    then the entries made from ranks; a group already registered (the global set, a ``comm.Dup()``, a list of
    ranks equal to a communicator's group) is registered once.  Collective over the job when an entry is a
    communicator; every rank gets the same table."""
    for ps in sets:
        if ps.mpi_comm is None:
            error = process_set_ranks_error(ps.ranks, world_size)
            if error:
                raise ValueError(error)
    groups: list[list[int]] = []
    comm_sets = [ps for ps in sets if ps.mpi_comm is not None]
    if comm_sets:
        if mpi is None:
            raise ValueError("Process sets from mpi4py communicators need the MPI controller.")
        from horovod.transport.mpi import _allgather_json

        mine = [_comm_ranks(ps.mpi_comm, mpi) for ps in comm_sets]
        everyone = _allgather_json(mpi.comm, mine)
        if any(len(theirs) != len(mine) for theirs in everyone):
            raise ValueError("Horovod could not be initialized: ranks passed different numbers of process sets "
                             f"made from MPI communicators to init() ({[len(theirs) for theirs in everyone]}).")
        for i in range(len(comm_sets)):
            groups += sorted({tuple(theirs[i]) for theirs in everyone if theirs[i] is not None})
    groups += [tuple(ps.ranks) for ps in sets if ps.mpi_comm is None]
    table: list[list[int]] = []
    for group in groups:
        if list(group) != list(range(world_size)) and list(group) not in table:
            table.append(list(group))
    return table


def _match_static_sets(sets: list[ProcessSet], table: dict[int, list[int]], mpi) -> None:
    """Give each object of ``init(process_sets=...)`` the id of its registered set (upstream's
    ``_init_process_sets``); an entry whose set an earlier entry of the list already has (the global set
    counts) is left unregistered, and the first such entry is named in upstream's ValueError.  An object
    made from ``MPI.COMM_NULL`` stays unregistered."""
    by_ranks = {tuple(ranks): pid for pid, ranks in table.items()}
    seen = {0}
    duplicate: tuple[int, ProcessSet] | None = None
    for i, ps in enumerate(sets):
        if ps.mpi_comm is not None:
            if mpi is None:
                raise ValueError("Process sets from mpi4py communicators need the MPI controller.")
            ranks = _comm_ranks(ps.mpi_comm, mpi)
            if ranks is None:
                continue
            ps.ranks = ranks
        pid = by_ranks.get(tuple(sorted(ps.ranks)))
        if pid is None:
            raise ValueError(f"{ps} is not one of the process sets of the running job (init() was called before "
                             "with other process sets; add it with hvd.add_process_set() and "
                             "HOROVOD_DYNAMIC_PROCESS_SETS=1, or shutdown() first)")
        if pid in seen:
            ps.process_set_id = None
            if duplicate is None:
                duplicate = (i, ps)
        else:
            ps.process_set_id = pid
            seen.add(pid)
    if duplicate is not None:
        raise ValueError(f"Horovod could not be initialized because process_sets entry number {duplicate[0]} is a "
                         f"duplicate: {duplicate[1]}")


_uncaught: str | None = None  # the exception ending this process, for the cause the other ranks see


def _recording_excepthook(previous):
    """``sys.excepthook`` that notes the exception ending the program, then runs ``previous`` (it prints)."""

    def hook(exc_type, exc, tb):
        global _uncaught
        text = str(exc).strip().splitlines()
        _uncaught = exc_type.__name__ + (f": {text[0][:200]}" if text else "")
        previous(exc_type, exc, tb)

    return hook


def _shutdown_at_exit() -> None:
    """At interpreter exit: the other ranks' pending operations fail naming this rank and, when an uncaught
    exception ends the program, that exception (not only "called shutdown()")."""
    engine = _engine
    _stop(None if _uncaught is None or engine is None else f"rank {engine.rank} exited with an uncaught {_uncaught}")


def shutdown() -> None:
    """Stop the engine; pending operations fail with the shut-down error.  Safe when not initialized.

    Ends the generation for every rank (their pending and later operations fail with ShutdownError naming
    this rank); the next init() starts a new one.
    """
    _stop(None)


def _stop(reason: str | None) -> None:
    global _initialized
    with _lock:
        engine = _engine
        _initialized = False
        if engine is None or engine.forked_from is not None:  # a forked child: the rank owns all of it
            return
        engine.shutdown(reason)
        for ps in _static_sets:
            ps._invalidate()
        _release_mpi()


def _release_mpi() -> None:
    global _mpi
    if _mpi is not None:
        _mpi.close()
        _mpi = None


def engine() -> Engine:
    """The running engine, or ValueError (upstream's text) before init() and after this process's own
    shutdown() (upstream clears its initialised flag there: a collective then fails as before init, not with
    the shut-down error, which stays for a shutdown another rank caused)."""
    e = _engine
    if e is None or not _initialized:
        raise ValueError(NOT_INITIALIZED)
    return e


def global_comm():
    """The mpi4py communicator the running job was initialised with (``init(comm=...)`` under MPI), else None."""
    return _global_comm if _initialized else None


def is_initialized() -> bool:
    """True from init() until this process's shutdown() (a peer's shutdown does not change it, as upstream)."""
    return _initialized


def _topo() -> Topology:
    """The layout of this process's job; ValueError (upstream's text) before init() and after shutdown()."""
    e = _engine
    if e is None or not _initialized:
        raise ValueError(NOT_INITIALIZED)
    return e.topology


def rank() -> int:
    return _topo().rank


def size() -> int:
    return _topo().size


def local_rank() -> int:
    return _topo().local_rank


def local_size() -> int:
    return _topo().local_size


def cross_rank() -> int:
    return _topo().cross_rank


def cross_size() -> int:
    return _topo().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (from the launcher's layout)."""
    topo = _topo()
    return topo.size == topo.local_size * topo.cross_size


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (so the application may call MPI from its threads)."""
    engine()
    if _mpi is None:
        raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and enabled.")
    return bool(_mpi.threads)


def mpi_enabled() -> bool:
    """True while the job was bootstrapped through MPI (mpirun/srun or ``init(comm=...)``)."""
    return _mpi is not None and is_initialized()


def mpi_built() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def gloo_enabled() -> bool:
    return is_initialized() and _mpi is None


def gloo_built() -> bool:
    return True


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def sycl_built() -> bool:
    """No SYCL (Intel GPU) support; upstream's newer examples call it to choose the device kind."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the timeline to ``file_path`` (needs ``HOROVOD_TIMELINE=DYNAMIC`` or a file at init)."""
    e = engine()
    if not e.config.timeline:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    if e.timeline is not None:
        e.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    e = engine()
    if e.timeline is not None:
        e.timeline.stop()


def show_in_timeline_as(name: str, members: Sequence[str]) -> None:
    """Draw the collective named ``name`` (its core name, e.g. ``allreduce.bucket.x``) on the timeline rows of
    ``members``: an adapter that reduces several tensors as one (horovod.torch's gradient buckets) keeps a row
    per tensor, as upstream's timeline has.  Kept across re-initialisation (elastic resets)."""
    _timeline_rows[name] = tuple(members)
    e = _engine
    if e is not None and e.timeline is not None:
        e.timeline.show_as(name, _timeline_rows[name])


# ---------------------------------------------------------------------- dynamic process sets
def add_process_set(ps: ProcessSet) -> ProcessSet:
    global _dynamic_counter
    e = engine()
    if not e.config.dynamic_process_sets:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod "
                         "initialization.")
    if ps.ranks is None:
        raise NotImplementedError("Adding process sets from mpi4py communicators needs the MPI controller.")
    if ps.process_set_id is not None or ps.ranks in e.set_table().values():
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    with _lock:
        _dynamic_counter += 1
        name = f"process_set.add.{_dynamic_counter}"
    req = Request(RequestType.ADD_PROCESS_SET, 0, name, splits=tuple(ps.ranks))
    payload = e.enqueue([(req, None, None)])[0].wait()
    ps.process_set_id = payload[0]
    naming.reset(ps.process_set_id)
    return ps


def remove_process_set(ps: ProcessSet) -> bool:
    global _dynamic_counter
    e = engine()
    if ps.process_set_id is None or ps.process_set_id == 0:
        return False
    with _lock:
        _dynamic_counter += 1
        name = f"process_set.remove.{_dynamic_counter}"
    req = Request(RequestType.REMOVE_PROCESS_SET, 0, name, splits=(ps.process_set_id,))
    e.enqueue([(req, None, None)])[0].wait()
    ps._invalidate()
    return True


def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Upstream's name: every registered process set's global ranks, by id."""
    return engine().set_table()


def _comm_process_set_id(comm) -> int:
    """Upstream's: the id of the registered process set whose ranks are those of the mpi4py communicator
    ``comm`` (a ``Dup()`` of a set's communicator matches it too)."""
    e = _engine
    if e is None or not _initialized or _mpi is None:
        raise ValueError("Horovod has not been initialized or MPI has not been enabled; use hvd.init().")
    ranks = _comm_ranks(comm, _mpi)
    for pid, members in e.set_table().items():
        if ranks is not None and members == ranks:
            return pid
    raise ValueError("MPI communicator does not correspond to any registered process set.")


def process_set_ranks(process_set_id: int | None) -> list[int] | None:
    """The global ranks of the registered process set ``process_set_id`` (None: not registered).

    Adapters ask this rather than the engine: the set table changes when dynamic sets are added or removed.
    Raises ValueError (upstream's text) before init.
    """
    e = engine()
    return None if process_set_id is None else e.set_ranks(process_set_id)


class HorovodBasics:
    """Upstream's class; every method delegates to the module-level functions above."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        value = globals().get(name)
        if value is None or name.startswith("__"):
            raise AttributeError(name)
        return value
