"""Process sets: subsets of ranks that run collectives among themselves.

Id 0 is the global set; static sets passed to ``init(process_sets=...)`` get ids 1, 2, ... in order;
dynamic sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``init(process_sets="dynamic")``) are added and removed
collectively and get ids from the coordinator (freed ids are reused first-in first-out).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from horovod.common import basics

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """A set of global ranks; ``process_set_id`` is None until the set is registered."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Iterable[int] | object) -> None:
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks = None
            return
        try:
            ranks = list(ranks_or_comm)  # type: ignore[arg-type]
        except TypeError:
            ranks = None
        if ranks is None or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py "
                             "Comm object")
        self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        if self.process_set_id is None:
            return None
        return len(self.ranks or [])

    def rank(self) -> int | None:
        if self.process_set_id is None:
            return None
        me = basics.rank()
        if me not in (self.ranks or []):
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        if self.ranks is None:
            return None
        return basics.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Id 0: every rank of the running job (no ranks before the first ``init()``)."""

    process_set_id = 0

    def __init__(self) -> None:  # noqa: D107 - nothing to store: the ranks follow the job
        pass

    @property
    def ranks(self) -> list[int]:  # type: ignore[override]
        try:
            return list(range(basics.size()))
        except ValueError:  # before the first init()
            return []

    @property
    def mpi_comm(self):  # type: ignore[override]
        """The communicator given to ``init(comm=...)`` under MPI (upstream's), else None."""
        return basics.global_comm()

    def _invalidate(self) -> None:
        pass  # the global set stays registered across init() generations


global_process_set = _GlobalProcessSet()


def _normalize(ps_or_ranks: ProcessSet | Sequence[int]) -> ProcessSet:
    return ps_or_ranks if isinstance(ps_or_ranks, ProcessSet) else ProcessSet(ps_or_ranks)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set on every rank (collective: all ranks call it in the same order)."""
    return basics.add_process_set(_normalize(process_set))


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (collective); False for the global or an unknown set."""
    return basics.remove_process_set(process_set)
