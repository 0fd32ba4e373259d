"""MPI as bootstrap and data plane: jobs started by ``mpirun``, ``srun`` or ``hvd.init(comm=...)``.

Design (docs/running.md has the user's view):

* **Launch detection** (:func:`detect_launch`): Open MPI (``OMPI_COMM_WORLD_*``), MPICH/Hydra and Intel MPI
  (``PMI_RANK``/``PMI_SIZE``, ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``) and Slurm steps (``SLURM_PROCID``,
  ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_LOCALID``).  ``horovodrun``'s own ``HOROVOD_RANK`` wins.
* **srun without a PMI server its MPI can use** (``--mpi=none``, Slurm's default, or ``--mpi=pmi2`` with an
  Open MPI built without PMI-2; :func:`slurm_without_pmi`): the tasks meet without MPI
  (``horovod.common.slurm``); told to use MPI anyway (``HOROVOD_CONTROLLER=mpi``), Open MPI is refused before
  ``MPI_Init`` (which would end the process with Open MPI's advice to rebuild it) with the fixes.
* **Bootstrap through MPI**: the rank layout comes from the job's communicator (a private duplicate of
  ``COMM_WORLD``, of the user's communicator, or of the group of the listed ranks), ``local`` ranks from
  ``Split_type(COMM_TYPE_SHARED)``; rank 0 makes the job key and broadcasts it; the addresses of the mesh
  are exchanged with ``allgather`` (:class:`MpiStore`) instead of the launcher's HTTP store.
* **Control plane**: stays on the mesh's authenticated sockets (the engine waits on them with ``select``,
  which MPI cannot offer without polling).
* **Data plane**: :class:`MpiCommunicator` runs the collectives with mpi4py's buffer interface
  (``Allreduce``, ``Allgatherv``, ``Bcast``, ``Alltoallv``, ``Reduce_scatter``, ``Barrier``) on one
  sub-communicator per process set, created by the set's members only (``Create_group``).  float16 and
  bfloat16, which MPI has no type for, are reduced by a user-defined op over 16-bit words.

MPI is initialised with ``MPI_THREAD_MULTIPLE`` (the engine thread and the user's own mpi4py calls may run
at the same time, on different communicators) unless ``HOROVOD_MPI_THREADS_DISABLE=1``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from horovod.transport import netif
from horovod.transport.communicator import Communicator, ReduceOp

__all__ = ["LaunchEnv", "detect_launch", "slurm_without_pmi", "open_mpi_without_pmi2", "open_mpi_components",
           "library_version", "import_mpi", "MpiJob", "MpiStore", "MpiCommunicator", "mpi_job", "mpi_available"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ launch detection
@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What a process launcher says about this process (before MPI is initialised)."""

    kind: str  # "openmpi", "mpich" (PMI: Hydra, Intel MPI) or "slurm" (srun; --mpi=pmi2's PMI_RANK too)
    rank: int
    size: int
    local_rank: int | None = None
    local_size: int | None = None


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def _slurm_tasks_on_node(spec: str, node_id: int) -> int | None:
    """``SLURM_STEP_TASKS_PER_NODE`` ("2(x3),1") expanded, entry ``node_id``."""
    counts: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if "(x" in part:
            n, rep = part.rstrip(")").split("(x")
            counts += [int(n)] * int(rep)
        elif part.isdigit():
            counts.append(int(part))
    return counts[node_id] if 0 <= node_id < len(counts) else None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The MPI/Slurm launcher that started this process, from its environment; None for others.

    ``horovodrun`` (Gloo-style) workers have ``HOROVOD_RANK`` and are never reported as MPI launches.
    A Slurm batch script (no ``srun`` step: no ``SLURM_STEP_NUM_TASKS``) is not a launch either.
    """
    env = os.environ if env is None else env
    if env.get("HOROVOD_RANK"):
        return None
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    if rank is not None and size is not None:
        return LaunchEnv("openmpi", rank, size, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))
    rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    if rank is not None and size is not None and not _srun_pmi(env):
        return LaunchEnv("mpich", rank, size, _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"))
    rank = _int(env, "SLURM_PROCID")
    size = _int(env, "SLURM_STEP_NUM_TASKS")
    if rank is not None and size is not None:
        node = _int(env, "SLURM_NODEID")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        local_size = _slurm_tasks_on_node(per_node, node) if node is not None else None
        return LaunchEnv("slurm", rank, size, _int(env, "SLURM_LOCALID"), local_size)
    return None


def _srun_pmi(env: Mapping[str, str]) -> bool:
    """``PMI_RANK``/``PMI_SIZE`` are srun's own (``--mpi=pmi2``: its PMI-2 server), not an MPICH launcher's
    (Hydra's ``mpiexec``, even one started inside an srun step, numbers its own processes)."""
    return (bool(env.get("SLURM_MPI_TYPE", "").strip()) and env.get("PMI_FD", "").strip() != ""
            and env.get("PMI_RANK", "").strip() == env.get("SLURM_PROCID", "").strip()
            and env.get("PMI_SIZE", "").strip() == env.get("SLURM_STEP_NUM_TASKS", "").strip())


def slurm_without_pmi(launch: LaunchEnv | None, env: Mapping[str, str] | None = None) -> bool:
    """srun started this task with no PMI server that this process's MPI can use.

    ``--mpi=none`` (Slurm's default ``MpiDefault``): Open MPI aborts the process inside ``MPI_Init`` (its
    text suggests rebuilding Open MPI, not ``--mpi=pmix``), and an MPI that falls back to a singleton runs
    every task as a job of size 1; only an MPI linked to Slurm's PMI-1 library (``libpmi.so``, e.g. Intel MPI
    with ``I_MPI_PMI_LIBRARY``) connects the tasks.  ``--mpi=pmi2`` (a common ``MpiDefault``) with an Open MPI
    that cannot use PMI-2 (:func:`open_mpi_without_pmi2`) aborts the same way.  Verified with Debian's Slurm
    22.05 and Open MPI 4.1 (tests/multihost/test_slurm.py).
    """
    env = os.environ if env is None else env
    if launch is None or launch.kind != "slurm" or env.get("PMIX_RANK", "").strip() \
            or env.get("PMIX_NAMESPACE", "").strip():
        return False
    if not env.get("PMI_FD", "").strip():
        return True
    return open_mpi_without_pmi2()


def open_mpi_without_pmi2() -> bool:
    """mpi4py's MPI is an Open MPI that cannot join srun's PMI-2 server (``srun --mpi=pmi2``).

    Open MPI 5 speaks PMIx only; Open MPI 3 and 4 speak PMI-1/2 through their ``pmix`` components ``s1``/``s2``,
    built only ``--with-pmi`` (Debian's are not).  False when unsure (another MPI, no mpi4py, components
    built into the library): MPI is then left to try.
    """
    if not mpi_available():
        return False
    try:
        version = library_version()
    except Exception:  # noqa: BLE001 - a broken mpi4py is named where MPI is initialised
        return False
    major = re.match(r"\s*Open MPI v(\d+)", version)
    if major is None:
        return False
    if int(major.group(1)) >= 5:
        return True
    components = open_mpi_components("pmix")
    return components is not None and not components & {"s1", "s2"}


def open_mpi_components(framework: str, maps: str = "/proc/self/maps",
                        env: Mapping[str, str] | None = None) -> set[str] | None:
    """The components of Open MPI's ``framework`` installed for the ``libmpi`` this process loaded
    (``mca_<framework>_<name>.so`` in ``<libdir>/openmpi*``, Debian's ``<libdir>/openmpi/lib/openmpi*``, or
    ``OMPI_MCA_mca_component_path``); None when that cannot be told."""
    env = os.environ if env is None else env
    try:
        with open(maps) as f:
            lib = next((line.split(None, 5)[-1].strip() for line in f if "/libmpi.so" in line), None)
    except OSError:
        return None
    if lib is None:
        return None
    libdir = os.path.dirname(lib)
    dirs = glob.glob(os.path.join(libdir, "openmpi*")) + glob.glob(os.path.join(libdir, "openmpi", "lib", "openmpi*"))
    dirs += [d for d in env.get("OMPI_MCA_mca_component_path", "").split(os.pathsep) if d]
    prefix = f"mca_{framework}_"
    found: set[str] | None = None
    for sub in sorted(set(dirs)):
        names = [n for n in os.listdir(sub) if n.startswith("mca_")] if os.path.isdir(sub) else []
        if names:
            found = (found or set()) | {n[len(prefix):].split(".")[0] for n in names if n.startswith(prefix)}
    return found


def library_version() -> str:
    """``MPI_Get_library_version`` without initialising MPI (the standard allows it before ``MPI_Init``).

    Tells Open MPI from the others while a refusal can still be raised: Open MPI's ``MPI_Init`` under srun
    without PMI ends the process.  When this imports ``mpi4py.MPI`` it defers initialisation to
    :func:`import_mpi` and keeps mpi4py's finalisation at exit (Open MPI's launchers report a process that
    exits initialised and not finalised as failed).
    """
    import sys

    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        if mpi4py.rc.finalize is None:
            mpi4py.rc.finalize = True
    from mpi4py import MPI

    return MPI.Get_library_version()


def mpi_available() -> bool:
    """Whether mpi4py can be imported (without initialising MPI)."""
    import importlib.util

    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False


def import_mpi(threads: bool = True) -> Any:
    """``mpi4py.MPI``, initialising MPI with ``THREAD_MULTIPLE`` (``SERIALIZED`` when ``threads`` is False)
    unless the application initialised it already."""
    import mpi4py

    if "mpi4py.MPI" not in __import__("sys").modules:
        mpi4py.rc.thread_level = "multiple" if threads else "serialized"
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE if threads else MPI.THREAD_SERIALIZED)
    if threads and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        logger.warning("MPI provides thread level %d, not MPI_THREAD_MULTIPLE: do not call MPI from other "
                       "threads while Horovod runs", MPI.Query_thread())
    return MPI


# ------------------------------------------------------------------------------------------ bootstrap
class MpiStore:
    """The rendezvous store's ``put``/``get`` over one ``allgather``: every rank puts exactly once, then gets.

    ``build_mesh`` publishes one address record per rank and reads everybody else's; the first ``get`` after
    the ``put`` is the collective point.  ``addr`` is a host the mesh may probe a route to (see
    ``mesh.advertise_address``).
    """

    def __init__(self, comm: Any, addr: str | None = None) -> None:
        self.comm = comm
        self.addr = addr
        self._mine: tuple[str, bytes] | None = None
        self._all: dict[str, bytes] | None = None

    def put(self, key: str, value: bytes) -> None:
        self._mine = (key, bytes(value))
        self._all = None

    def get(self, key: str, timeout: float | None = None) -> bytes:
        if self._all is None:
            if self._mine is None:
                raise RuntimeError("MpiStore.get before put: every rank must publish first")
            key_, value = self._mine
            records = allgather_bytes(self.comm, json.dumps([key_, value.hex()]).encode())
            self._all = {k: bytes.fromhex(v) for k, v in map(json.loads, records)}
        return self._all[key]


# Start-up exchanges use buffer collectives and JSON, never mpi4py's pickling lower-case calls: nothing that
# arrives over MPI's transport is unpickled (docs/security.md).
def allgather_bytes(comm: Any, mine: bytes) -> list[bytes]:
    """Every rank's ``mine``, in rank order, as raw bytes (two buffer collectives, no pickle)."""
    from mpi4py import MPI

    counts = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([len(mine)], np.int64), counts)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    out = np.empty(int(counts.sum()), np.uint8)
    comm.Allgatherv(np.frombuffer(mine, np.uint8), [out, counts.tolist(), displs.tolist(), MPI.BYTE])
    return [out[d:d + c].tobytes() for d, c in zip(displs, counts)]


def _allgather_json(comm: Any, value: Any) -> list[Any]:
    return [json.loads(b) for b in allgather_bytes(comm, json.dumps(value).encode())]


def _bcast_bytes(comm: Any, value: bytes | None, size: int, root: int = 0) -> bytes:
    buf = np.frombuffer(value, np.uint8).copy() if comm.Get_rank() == root else np.empty(size, np.uint8)
    comm.Bcast(buf, root=root)
    return buf.tobytes()


def _local_ipv4() -> list[str]:
    """This host's non-loopback IPv4 addresses (the candidates other nodes may reach it at)."""
    return [a for addrs in netif.interface_addresses().values() for a in addrs if not a.startswith("127.")]


@dataclasses.dataclass
class MpiJob:
    """The job's communicator and this process's place in it."""

    comm: Any  # mpi4py.MPI.Intracomm, private to Horovod
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    key: bytes
    iface_addr: str
    threads: bool

    def close(self) -> None:
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - MPI may already be finalised at exit
            pass


def mpi_job(comm: Any = None, *, threads: bool = True, iface: str | None = None) -> MpiJob | None:
    """Set up the job's communicator: ``comm`` is None (``COMM_WORLD``), an mpi4py communicator, or a list
    of ``COMM_WORLD`` ranks.  Collective over the job's ranks.

    Returns None on a ``COMM_WORLD`` rank that is not in the list (it takes no part in the job).
    """
    MPI = import_mpi(threads)
    if comm is None:
        job = MPI.COMM_WORLD.Dup()
    elif isinstance(comm, (list, tuple)):
        # in the list's order, as upstream's MPI_Group_incl: comm=[3, 1] makes world rank 3 Horovod's rank 0
        ranks = [int(r) for r in comm]
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        if repeated:
            raise ValueError(f"hvd.init(comm={list(comm)}): ranks {repeated} are listed more than once")
        world = MPI.COMM_WORLD
        if not ranks:
            job = world.Dup()
        else:
            bad = [r for r in ranks if r < 0 or r >= world.Get_size()]
            if bad:
                raise ValueError(f"hvd.init(comm={list(comm)}): ranks {bad} are not in MPI_COMM_WORLD "
                                 f"(size {world.Get_size()})")
            if world.Get_rank() not in ranks:
                return None
            group = world.Get_group().Incl(ranks)
            job = world.Create_group(group, tag=7001)
            group.Free()
    else:
        job = comm.Dup()
    rank, size = job.Get_rank(), job.Get_size()
    local = job.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    cross = job.Split(color=local_rank, key=rank)
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    leader = np.array([rank], np.int64)
    local.Bcast(leader, root=0)
    node_leader = int(leader[0])
    local.Free()
    cross.Free()
    key = _bcast_bytes(job, os.urandom(32) if rank == 0 else None, 32)
    hostname = MPI.Get_processor_name()
    names = _allgather_json(job, hostname)
    leaders = _allgather_json(job, node_leader)
    # One node name on distinct nodes (containers, namespaces) must not make the mesh treat them as one host.
    if any(n == hostname and lead != node_leader for n, lead in zip(names, leaders)):
        hostname = f"{hostname}#{node_leader}"
    candidates = _allgather_json(job, _local_ipv4())
    iface_addr = _choose_address(rank, leaders, candidates, iface)
    return MpiJob(job, rank, size, local_rank, local_size, cross_rank, cross_size, hostname, key, iface_addr,
                  MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


def _choose_address(rank: int, leaders: list[int], candidates: list[list[str]], iface: str | None) -> str:
    """The address this rank listens on: the named interface, loopback for a one-node job, else the source
    address of the route to another node."""
    if iface:
        addr = netif.interface_address(iface)
        if addr:
            return addr
        logger.warning("HOROVOD_GLOO_IFACE=%s has no IPv4 address on this host; choosing by route", iface)
    mine = leaders[rank]
    others = [c for r, c in enumerate(candidates) if leaders[r] != mine and c]
    if not others:
        return "127.0.0.1"
    from horovod.transport.mesh import advertise_address

    return advertise_address(None, others[0][0])


# ------------------------------------------------------------------------------------------ data plane
_BF16_NAME = "bfloat16"


def _mpi_op(MPI: Any, op: ReduceOp, dtype: np.dtype) -> Any:
    if dtype == np.bool_:
        return {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND,
                ReduceOp.PRODUCT: MPI.LAND}[op]
    return {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}[op]


_USER_OPS: dict[tuple[str, ReduceOp], Any] = {}


def _half_op(MPI: Any, op: ReduceOp, dtype: np.dtype) -> Any:
    """A user-defined MPI op reducing 16-bit floats (sent as ``MPI_UINT16_T``) with numpy."""
    key = (dtype.str if dtype.name != _BF16_NAME else _BF16_NAME, op)
    user = _USER_OPS.get(key)
    if user is None:
        from horovod.transport.communicator import apply_reduce

        def reduce(inbuf: Any, outbuf: Any, datatype: Any) -> None:
            a = np.frombuffer(inbuf, dtype=dtype)
            b = np.frombuffer(outbuf, dtype=dtype)
            apply_reduce(op, b, a)

        user = MPI.Op.Create(reduce, commute=True)
        _USER_OPS[key] = user
    return user


class MpiCommunicator(Communicator):
    """Collectives among ``ranks`` of the job's communicator with mpi4py buffer calls.

    Raises:
        ValueError: this rank is not in ``ranks``.
    """

    data_plane = "MPI"

    def __init__(self, job_comm: Any, ranks: list[int]) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.ranks = sorted(int(r) for r in ranks)
        me = job_comm.Get_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not a member of {self.ranks}")
        self.rank, self.size = self.ranks.index(me), len(self.ranks)
        self._owned = self.ranks != list(range(job_comm.Get_size()))
        if self._owned:
            group = job_comm.Get_group().Incl(self.ranks)
            self.comm = job_comm.Create_group(group, tag=7002)
            group.Free()
        else:
            self.comm = job_comm

    def _buf(self, arr: np.ndarray) -> list[Any]:
        dtype = arr.dtype
        if dtype.itemsize == 2 and dtype.kind not in "iu":  # float16, bfloat16: MPI has no such type
            return [arr.view(np.uint16), self.MPI.UINT16_T]
        return [arr, self.MPI.Datatype.fromcode(dtype.char) if dtype != np.bool_ else self.MPI.C_BOOL]

    def _op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        if dtype.itemsize == 2 and dtype.kind not in "iu":
            return _half_op(self.MPI, op, dtype)
        return _mpi_op(self.MPI, op, dtype)

    def allreduce(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        if inp.size == 0:
            return
        send = self.MPI.IN_PLACE if inp is out or np.shares_memory(inp, out) else self._buf(inp)
        if send is self.MPI.IN_PLACE and inp is not out:
            out[...] = inp
        self.comm.Allreduce(send, self._buf(out), op=self._op(op, inp.dtype))

    def allgatherv(self, inp: np.ndarray, out: np.ndarray, counts: list[int]) -> None:
        displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(int).tolist()
        buf, dtype = self._buf(out)
        send = self._buf(inp)
        self.comm.Allgatherv(send, [buf, list(counts), displs, dtype])

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if buf.size:
            self.comm.Bcast(self._buf(buf), root=root)

    def alltoallv(self, inp: np.ndarray, send_counts: list[int], out: np.ndarray,
                  recv_counts: list[int]) -> None:
        sd = np.concatenate([[0], np.cumsum(send_counts[:-1])]).astype(int).tolist()
        rd = np.concatenate([[0], np.cumsum(recv_counts[:-1])]).astype(int).tolist()
        sbuf, stype = self._buf(inp)
        rbuf, rtype = self._buf(out)
        self.comm.Alltoallv([sbuf, list(send_counts), sd, stype], [rbuf, list(recv_counts), rd, rtype])

    def reducescatterv(self, inp: np.ndarray, out: np.ndarray, counts: list[int], op: ReduceOp) -> None:
        if sum(counts) == 0:
            return
        self.comm.Reduce_scatter(self._buf(inp), self._buf(out), list(counts), op=self._op(op, inp.dtype))

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        if self._owned:
            try:
                self.comm.Free()
            except Exception:  # noqa: BLE001 - MPI may be finalised already
                pass


def describe(job: MpiJob) -> str:
    """One line for logs: library, thread level, layout."""
    from mpi4py import MPI

    return json.dumps({"library": MPI.Get_library_version().splitlines()[0], "threads": job.threads,
                       "rank": job.rank, "size": job.size, "local_size": job.local_size,
                       "cross_size": job.cross_size, "addr": job.iface_addr})
