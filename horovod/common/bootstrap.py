"""How a process learns its place in the job and gets connected to the others.

Four ways in: the launcher's environment and rendezvous store (``horovodrun``), MPI (``mpirun``/``srun`` or
``init(comm=...)``: layout, job key and addresses exchanged over the communicator), the elastic driver
(``horovod.common.elastic_init``), and the variables of a launcher without a store of ours: torchrun's
(``horovod.common.torchrun``), srun's and one-host mpirun's without MPI (``horovod.common.slurm``,
``horovod.common.mpirun_join``); rank 0 runs the store (``horovod.common.store_join``), the launcher's
variables are exported, then the first way goes on.
``horovod.common.basics.init`` picks one and starts the engine.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from horovod.base import auth
from horovod.base.config import is_set, read_env, start_timeout
from horovod.runtime.engine import Topology
from horovod.transport.communicator import PeerFailure

__all__ = ["refuse_a_copy_of_a_rank", "claim_rank",
           "topology_from_env", "topology_from_mpi", "use_mpi", "mpi_job", "check_comm_matches_launch",
           "elastic_mesh", "build_mesh",
           "join_torchrun", "join_without_mpi", "GenerationMismatch"]

log = logging.getLogger(__name__)


def topology_from_env() -> Topology:
    """The rank layout the launcher put in the environment (size 1 without a launcher).

    Raises:
        ValueError: a variable is not a whole number, or a rank is not below its size (the text names both).
    """
    layout = {}
    for kind in ("", "LOCAL_", "CROSS_"):
        rank_name, size_name = f"HOROVOD_{kind}RANK", f"HOROVOD_{kind}SIZE"
        rank, size = read_env(rank_name), read_env(size_name)
        if rank >= size:
            raise ValueError(f"{rank_name}={rank} must be below {size_name}={size} (the launcher sets both; "
                             "unset them to run a single process)")
        layout[kind.lower() + "rank"], layout[kind.lower() + "size"] = rank, size
    return Topology(**layout, hostname=read_env("HOROVOD_HOSTNAME") or socket.gethostname())


# "<pid> <slot>" of the process that last initialized as the launcher slot <slot>, inherited by its children.
RANK_OWNER_ENV = "_HOROVOD_RANK_OWNER"


def _slot() -> str | None:
    """This process's place in its launch, from the raw environment: rendezvous store, host, local rank
    (None without a rendezvous: a single process, or MPI)."""
    env = os.environ
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        return None
    return f"{addr}:{port}/{env.get('HOROVOD_HOSTNAME', '')}/{env.get('HOROVOD_LOCAL_RANK', '')}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refuse_a_copy_of_a_rank() -> None:
    """``init()`` in a process that inherited a live rank's whole environment (a ``spawn``/``forkserver``
    DataLoader or multiprocessing worker re-running an unguarded main module, a forked child) would join the
    job as a second copy of that rank: the store's keys of the running job answer it, and the job broke
    after the start timeout with errors that named neither process.

    Raises:
        RuntimeError: naming both processes and the ``__main__`` guard.
    """
    slot, owner = _slot(), os.environ.get(RANK_OWNER_ENV, "")
    pid, _, owner_slot = owner.partition(" ")
    if slot is None or owner_slot != slot or not pid.isdigit() or int(pid) == os.getpid() or not _alive(int(pid)):
        return
    rank = os.environ.get("HOROVOD_RANK", "?")
    raise RuntimeError(
        f"Horovod initialization failed: this process (pid {os.getpid()}) has the environment of rank {rank}, "
        f"which process {pid} already initialized: a second process cannot join the job as the same rank. A "
        "DataLoader or multiprocessing worker started with 'spawn' or 'forkserver' runs the main module again: "
        "put the training code under `if __name__ == '__main__':`, and call hvd.init() only in the processes "
        "the launcher started.")


def claim_rank() -> None:
    """Mark the environment as this process's, for :func:`refuse_a_copy_of_a_rank` in its children."""
    slot = _slot()
    if slot is not None:
        os.environ[RANK_OWNER_ENV] = f"{os.getpid()} {slot}"


def join_torchrun(comm=None) -> None:
    """Started by torchrun (or with its variables, e.g. a Kubeflow PyTorchJob) and not by horovodrun or MPI:
    meet the other ranks through rank 0's store and export ``HOROVOD_RANK``... (horovod/common/torchrun.py).

    An MPI ``comm`` (``init(comm=...)``) whose size is not torchrun's world is refused first, before any rank
    waits for the others (:func:`check_comm_matches_launch`)."""
    from horovod.common import store_join, torchrun

    launch = torchrun.detect()
    if launch is None:
        return
    from horovod.transport.mpi import detect_launch

    if detect_launch() is None:
        check_comm_matches_launch(comm, launch.world_size, launch.rank, "torchrun")
    store_join.join(launch)


def join_without_mpi(comm=None) -> None:
    """Started by srun (a step of several tasks), or by mpirun/mpiexec on one host, when MPI will not connect
    the processes (no mpi4py, no PMI server under srun, or ``HOROVOD_CONTROLLER=gloo``): meet the others
    through rank 0's store and export ``HOROVOD_RANK``... (horovod/common/slurm.py, mpirun_join.py).
    ``init(comm=...)`` always bootstraps through MPI."""
    if comm is not None and not isinstance(comm, (list, tuple)):
        return
    from horovod.common import mpirun_join, slurm, store_join

    launch = slurm.detect() or mpirun_join.detect()
    if launch is not None:
        store_join.join(launch)


def elastic_mesh():
    """Under the elastic driver, get rank and mesh from it: horovod/common/elastic_init.py."""
    from horovod.common import elastic_init

    if not elastic_init.launched_by_driver():
        return None

    return elastic_init.rendezvous()


def use_mpi(comm) -> bool:
    """MPI bootstraps the job: an mpi4py communicator was passed, or mpirun/srun started this process.

    Raises:
        ValueError: HOROVOD_CONTROLLER=gloo without horovodrun in a launch of several processes (srun -n 2,
            mpirun -np 2): nothing would connect them, and each would run alone as rank 0 of size 1.
    """
    if comm is not None and not isinstance(comm, (list, tuple)):
        return True
    if is_set("HOROVOD_RANK"):
        return False
    from horovod.transport.mpi import detect_launch, mpi_available, slurm_without_pmi

    launch = detect_launch()
    controller = read_env("HOROVOD_CONTROLLER")
    if controller == "gloo":
        if launch is not None and launch.size > 1:
            raise ValueError(
                f"{launch.kind} started {launch.size} processes (this is rank {launch.rank}) with "
                "HOROVOD_CONTROLLER=gloo across hosts, where only MPI can tell the processes where rank 0 is: "
                "each would run alone as rank 0 of size 1.  Unset HOROVOD_CONTROLLER to bootstrap through MPI, "
                "or start the job with horovodrun (or srun, whose tasks Horovod connects without MPI).")
        return False
    # A one-task srun step without PMI is a single process: run it as one, without MPI (Open MPI's MPI_Init
    # would end it: `srun python train.py` on a cluster whose MpiDefault is none).  So is one process of
    # mpirun or srun where mpi4py is not installed (nobody to join; unless MPI is asked for).
    if launch is not None and launch.size == 1:
        if slurm_without_pmi(launch) or (controller != "mpi" and not mpi_available()):
            return False
    return launch is not None


def check_comm_matches_launch(comm, size: int, rank: int, launcher: str) -> None:
    """``init(comm=...)`` in a process that horovodrun (Gloo) or torchrun started, not mpirun/srun: MPI did
    not connect those processes, so every one of them is an MPI singleton and the communicator (size 1) is not
    the job: each rank would silently run alone as rank 0 of size 1.

    Raises:
        ValueError: the communicator's size is not the launch's (the text names both and the fixes).
    """
    if comm is None or isinstance(comm, (list, tuple)):
        return
    try:
        comm_size = comm.Get_size()
    except AttributeError:
        return  # not an mpi4py communicator: mpi_mod.mpi_job names it
    if comm_size == size:
        return
    raise ValueError(
        f"hvd.init(comm=...) got an MPI communicator of size {comm_size}, but {launcher} started this process as "
        f"rank {rank} of a job of size {size}: MPI did not start these processes, so each one is an MPI job of "
        "its own.  To bootstrap through MPI, launch with mpirun (or horovodrun --mpi); "
        f"to run under {launcher}, call hvd.init() without comm=.")


def mpi_job(comm):
    """Bootstrap through MPI (mpirun/srun or ``init(comm=...)``); ValueError with the fix when impossible."""
    from horovod.transport import mpi as mpi_mod

    launch = mpi_mod.detect_launch()
    if not mpi_mod.mpi_available():
        if launch is None:
            raise ValueError("Horovod has not been built with MPI support. Please reinstall with MPI support "
                             "or use the default (built-in) controller.")
        raise ValueError(f"This process was started by {launch.kind} (rank {launch.rank} of {launch.size}) but "
                         "mpi4py is not installed: pip install mpi4py, or start the job with horovodrun.")
    if mpi_mod.slurm_without_pmi(launch) and "Open MPI" in mpi_mod.library_version():
        # Refused before MPI_Init, which would end the process with Open MPI's advice to rebuild it.  Reached
        # only when told to use MPI (HOROVOD_CONTROLLER=mpi): otherwise such tasks join without MPI.
        served = os.environ.get("SLURM_MPI_TYPE", "pmi2") if os.environ.get("PMI_FD", "").strip() else ""
        why = (f"under srun --mpi={served}, but this Open MPI ({mpi_mod.library_version().split(',')[0].strip()}) "
               "cannot use Slurm's PMI-2 (Open MPI 5 speaks PMIx only; 3 and 4 need to be built --with-pmi)"
               if served else "without MPI process management (srun --mpi=none, Slurm's default), and "
               "Open MPI cannot connect them without it")
        raise ValueError(
            f"srun started {launch.size} tasks (this is task {launch.rank}) {why}: run srun --mpi=pmix "
            "(`srun --mpi=list` shows what your Slurm offers, MpiDefault=pmix in slurm.conf makes it the "
            "default), or unset HOROVOD_CONTROLLER=mpi and Horovod connects the tasks without MPI.")
    if launch is None and is_set("HOROVOD_SIZE"):  # horovodrun's Gloo workers (torchrun's: join_torchrun)
        check_comm_matches_launch(comm, read_env("HOROVOD_SIZE"), read_env("HOROVOD_RANK"), "horovodrun")
    job = mpi_mod.mpi_job(comm, threads=not read_env("HOROVOD_MPI_THREADS_DISABLE"),
                          iface=read_env("HOROVOD_GLOO_IFACE") or None)
    if job is None:
        raise ValueError(f"hvd.init(comm={comm}): this process is not one of the listed MPI_COMM_WORLD ranks; "
                         "only they may call init.")
    if comm is None and launch is not None and launch.size != job.size:
        job.close()
        raise ValueError(f"{launch.kind} started {launch.size} processes but MPI sees {job.size}: "
                         + ("run srun with --mpi=pmix (or pmi2) so that MPI connects the tasks, "
                            if launch.kind == "slurm" else "mpi4py uses a different MPI than the launcher; ")
                         + "or start the job with horovodrun.")
    log.debug("MPI job: rank %d of %d, local %d of %d, cross %d of %d, address %s", job.rank, job.size,
              job.local_rank, job.local_size, job.cross_rank, job.cross_size, job.iface_addr)
    return job


def topology_from_mpi(job) -> Topology:
    return Topology(rank=job.rank, size=job.size, local_rank=job.local_rank, local_size=job.local_size,
                    cross_rank=job.cross_rank, cross_size=job.cross_size, hostname=job.hostname)


class GenerationMismatch(PeerFailure, ValueError):
    """A peer is not in this rank's generation of ``init()`` (or reported that its ``init()`` failed).

    ``peer`` is that rank; the message names both generations.  Raised instead of waiting out the start
    timeout when the peer has already moved past this generation or failed it, else at the timeout.  A
    ``ValueError`` too: upstream's ``init()`` fails with one, and scripts catch that.
    """

    def __init__(self, peer: int, message: str) -> None:
        ConnectionError.__init__(self, message)
        self.peer = peer
        self.reason = message

    def __reduce__(self):  # rebuilt from its pickle (Ray, horovod.run) with both arguments
        return type(self), (self.peer, self.reason)


_STATE_KEY = "init/state.{rank}"  # JSON {"generation": g, "error": text or null}, overwritten every attempt
_POLL = 0.5  # seconds between looks at a missing peer's state while waiting for one of its keys


def _key_rank(key: str) -> int | None:
    """The rank whose key this is: keys of one generation end in ``.<rank>`` (``init.3/addr.1``)."""
    _, dot, tail = key.rpartition(".")
    return int(tail) if dot and tail.isdigit() else None


def record_exit(server, rank: int, code: int) -> None:
    """The launcher's note, in its store (``server``: get/put in process), that ``rank``'s process has exited:
    a peer waiting for it in ``init()`` fails within a poll, naming it, instead of waiting out the start
    timeout.  Static jobs only: there a rank is never replaced."""
    import json

    key = _STATE_KEY.format(rank=rank)
    try:
        state = json.loads(server.get(key) or b"{}")
    except ValueError:
        state = {}
    state = state if isinstance(state, dict) else {}
    state["exited"] = code
    server.put(key, json.dumps(state).encode())


class _GenerationStore:
    """The store as one ``init()`` generation sees it: a wait for a peer's key names a generation mismatch.

    Ranks meet in the scope ``init.<g>`` of their own ``init()`` count ``g``.  While a key of a peer is
    missing, the peer's last published state says why: it already moved past ``g`` (or failed ``g``), so
    the key will never come -> :class:`GenerationMismatch` at once; it is still before ``g`` when the
    deadline passes -> :class:`GenerationMismatch` naming both generations, not a bare store timeout.
    """

    def __init__(self, store, rank: int, generation: int) -> None:
        self._store = store
        self.rank = rank
        self.generation = generation
        self.addr = getattr(store, "addr", None)

    def put(self, key: str, value: bytes) -> None:
        self._store.put(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        from horovod.transport.store import StoreError

        wait = getattr(self._store, "timeout", 30.0) if timeout is None else timeout
        deadline = time.monotonic() + wait
        peer = _key_rank(key)
        while True:
            try:
                return self._store.get(key, timeout=max(0.0, min(_POLL, deadline - time.monotonic())))
            except StoreError as e:
                if not str(e).startswith("timed out waiting") or peer is None:
                    raise
                timed_out = e
            state = self.peer_state(peer)
            gen = state.get("generation") if state else None
            moved_on = isinstance(gen, int) and gen > self.generation
            failed = gen == self.generation and state.get("error")
            exited = state.get("exited") if state else None  # the launcher saw its process end
            expired = time.monotonic() >= deadline
            if not (moved_on or failed or expired or exited is not None):
                continue
            try:  # the key may have arrived between the two looks (the peer puts it before moving on)
                return self._store.get(key, timeout=0)
            except StoreError:
                pass
            if failed:
                raise GenerationMismatch(peer, f"Horovod initialization failed: rank {peer} failed to "
                                               f"initialize generation {gen}: {state['error']}")
            if exited is not None:
                when = "without calling init()" if gen is None else f"after generation {gen} of init()"
                raise GenerationMismatch(
                    peer, f"Horovod initialization failed: the process of rank {peer} exited (status {exited}) "
                          f"{when} while rank {self.rank} waited for it at generation {self.generation}: every "
                          "rank must call hvd.init() the same number of times")
            if moved_on or gen != self.generation:
                where = "never called init()" if gen is None else f"is at generation {gen} of init()"
                # A peer that never reached init() and has not exited is most often still starting (imports,
                # a busy or remote host): name the knob, as upstream's start-timeout errors do.
                slow = ("; or it is still starting: you may need to increase the --start-timeout parameter "
                        "(HOROVOD_START_TIMEOUT)") if gen is None else ""
                raise GenerationMismatch(
                    peer, f"Horovod initialization failed: rank {peer} {where} while rank {self.rank} waited "
                          f"{wait:.0f} s at generation {self.generation}: every rank must call hvd.init() and "
                          f"hvd.shutdown() the same number of times (did an init() fail, or a rank skip one?)"
                          f"{slow}")
            raise timed_out

    def peer_state(self, peer: int) -> dict | None:
        """What ``peer`` published about its latest ``init()`` attempt (None: nothing yet)."""
        import json

        from horovod.transport.store import StoreError

        try:
            state = json.loads(self._store.get(_STATE_KEY.format(rank=peer), timeout=0))
        except (StoreError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def publish(self, error: str | None = None) -> None:
        """Tell the other ranks which generation this rank is in (and, on failure, why it left it)."""
        import json

        self._store.put(_STATE_KEY.format(rank=self.rank),
                        json.dumps({"generation": self.generation, "error": error}).encode())

    def forget_previous(self) -> None:
        """Delete this rank's keys of the previous generation: every peer has left it once this one formed."""
        if self.generation > 1:
            try:
                for name in ("process_sets", "addr"):
                    self._store.delete(f"init.{self.generation - 1}/{name}.{self.rank}")
            except Exception as e:  # noqa: BLE001 - only tidiness of the store
                log.debug("could not delete generation %d's store keys: %s", self.generation - 1, e)


def build_mesh(topology: Topology, sets: list[list[int]], generation: int, mpi=None):
    """Connect this rank to every other one for ``init()`` number ``generation`` (through MPI or the store).

    ``sets`` are the ranks of the static process sets passed to ``init()``: every rank must pass the same.

    Raises GenerationMismatch (naming the peer and both generations) when the ranks are not in the same
    generation: fast when the peer already left it, else at the start timeout.
    """
    from horovod.transport import build_mesh as connect
    from horovod.transport.store import StoreClient

    scope = f"init.{generation}"
    if mpi is not None:
        from horovod.transport.mpi import MpiStore, allgather_bytes

        timeout = start_timeout()
        mine = [list(ranks) for ranks in sets]
        everyone = [json.loads(b) for b in allgather_bytes(mpi.comm, json.dumps(mine).encode())]
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                raise ValueError("Horovod initialization failed: ranks passed different process_sets to init() "
                                 f"(rank {topology.rank}: {mine}, rank {r}: {theirs}).")
        mesh = connect(topology.rank, topology.size, topology.hostname, MpiStore(mpi.comm), mpi.key,
                          scope=scope, timeout=timeout, iface_addr=mpi.iface_addr)
        if (read_env("HOROVOD_CPU_OPERATIONS") or "mpi") == "mpi":
            mesh.mpi_comm = mpi.comm  # make_communicator then picks horovod.transport.mpi for data
        return mesh
    addr = read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = read_env("HOROVOD_GLOO_RENDEZVOUS_PORT")
    key = auth.secret_key_from_env()
    if not addr or not port or key is None:
        raise ValueError("Horovod initialization failed: HOROVOD_SIZE > 1 but no rendezvous address or secret "
                         "key in the environment. Start the job with horovodrun.")
    timeout = start_timeout()
    store = _GenerationStore(StoreClient(addr, int(port), key, timeout=timeout), topology.rank, generation)
    store.publish()
    try:
        mesh = _meet(topology, sets, store, key, scope, timeout, addr)
    except Exception as e:
        try:  # peers waiting for this rank's keys fail at once with the cause instead of at their deadline
            store.publish(error=f"{type(e).__name__}: {e}"[:2000])
        except Exception:  # noqa: BLE001 - best effort: they still fail at their own deadline
            pass
        raise
    # Off the init path (two store round trips): only tidiness, so that re-init loops do not grow the store.
    threading.Thread(target=store.forget_previous, name="horovod-forget-keys", daemon=True).start()
    return mesh


def _meet(topology: Topology, sets: list[list[int]], store: _GenerationStore, key: bytes, scope: str,
          timeout: float, addr: str):
    """Compare the static process sets, then form the mesh, all through the launcher's store."""
    import json

    from horovod.transport import build_mesh as connect
    from horovod.transport.mesh import advertise_address
    from horovod.transport.netif import interface_address

    deadline = time.monotonic() + timeout
    # Every rank must pass the same static process sets: rank 0 compares everyone's, the others rank 0's.
    mine = json.dumps([list(ranks) for ranks in sets]).encode()
    store.put(f"{scope}/process_sets.{topology.rank}", mine)
    others = range(1, topology.size) if topology.rank == 0 else [0]
    for r in others:
        theirs = store.get(f"{scope}/process_sets.{r}", timeout=max(0.0, deadline - time.monotonic()))
        if theirs != mine:
            raise ValueError("Horovod initialization failed: ranks passed different process_sets to init() "
                             f"(rank {topology.rank}: {mine.decode()}, rank {r}: {theirs.decode()}).")
    # Listen and advertise on HOROVOD_GLOO_IFACE (--network-interface) if this host has it, else on the
    # interface that routes to the launcher's store (the network the launcher chose for the job).
    iface = read_env("HOROVOD_GLOO_IFACE")
    iface_addr = interface_address(iface) if iface else None
    if iface and iface_addr is None:
        log.warning("HOROVOD_GLOO_IFACE=%s has no IPv4 address on %s; using the route to %s", iface,
                    topology.hostname, addr)
    iface_addr = iface_addr or advertise_address(None, addr, topology.hostname)
    return connect(topology.rank, topology.size, topology.hostname, store, key, scope=scope, timeout=timeout,
                   iface_addr=iface_addr)
