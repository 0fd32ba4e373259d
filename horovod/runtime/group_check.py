"""Grouped collectives whose ranks passed different numbers of tensors under one name.

Members of a grouped call are named ``<base>_<i>of<n>``, so ranks that group different numbers of tensors
under one base never share a name and, judged name by name, look merely late: they would wait for each other
until the stall deadline (upstream: forever).  Their requests carry ``group_size`` (``n``), so that a plain
tensor named ``x_1of2`` is never taken for a member.  When one base is pending with sizes that no two ranks
share, every pending name of it fails with one error on every member, as soon as every member submitted its
part -- so that all of them fail the same call and go on in step.

The coordinator owns one :class:`GroupSizes` per process set and keeps only the glue to its own structures
(pending names, cache, ready list): it notes each member name that arrives in a full request
(:meth:`GroupSizes.note`), says when such a name completes (:meth:`GroupSizes.settled`), asks whether a
completed member may be cached (:meth:`GroupSizes.may_cache`), reports cache insertions and evictions, and,
for a base noted with a second size, asks which of its cached members to evict (:meth:`GroupSizes.vary`) and
which pending names fail with which error (:meth:`GroupSizes.mismatch`).

The check costs nothing per cache hit: a base is cached with one size at a time, and a base seen with two
sizes is evicted and never cached again (``varying``), so a differing size always arrives as a full request
(or as a hit on an evicted entry, which the coordinator notes too), which is where the check is made.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

from horovod.runtime.messages import OP_DISPLAY, Request

__all__ = ["GroupSizes", "group_base", "group_of", "group_size_error", "group_sizes_disagree"]


class _Waiting(Protocol):
    """A pending name as the coordinator keeps it: the requests its members sent so far, by rank."""

    requests: dict[int, Request]


def group_base(name: str, group_size: int) -> str | None:
    """The base of a grouped collective's member name ``<base>_<i>of<group_size>``; None when the name is not
    of that form (a peer's malformed request: it is then checked as a plain tensor)."""
    head, sep, tail = name.rpartition("_")
    suffix = f"of{group_size}"
    index = tail[:-len(suffix)]
    if not sep or not tail.endswith(suffix) or not index.isascii() or not index.isdigit():
        return None
    return head if 1 <= int(index) <= group_size else None


def group_of(req: Request) -> tuple[str, int] | None:
    """(base, size) of a grouped collective's member request, None for any other."""
    if not req.group_size:
        return None
    base = group_base(req.name, req.group_size)
    return None if base is None else (base, req.group_size)


def _member_names(base: str, size: int) -> list[str]:
    return [f"{base}_{j}of{size}" for j in range(1, size + 1)]


def group_sizes_disagree(sizes_by_rank: dict[int, set[int]]) -> bool:
    """Whether two ranks have pending groups of one base and no size in common.

    A rank may have several calls of one base in flight (asynchronous calls of different sizes); ranks that
    submit them in the same order always share the size of the oldest call not yet complete, so only
    disjoint sets are a mismatch."""
    distinct = list({frozenset(s) for s in sizes_by_rank.values()})
    return any(a.isdisjoint(b) for i, a in enumerate(distinct) for b in distinct[i + 1:])


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = [str(r) for r in ranks[:8]]
    if len(ranks) > 8:
        return f"ranks {', '.join(shown)}, ... ({len(ranks)} ranks)"
    return f"ranks {', '.join(shown[:-1])} and {shown[-1]}"


def _tensors_text(sizes: frozenset[int]) -> str:
    if len(sizes) == 1:
        (n,) = sizes
        return f"a group of {n} tensor{'s' if n != 1 else ''}"
    return f"groups of {' and '.join(str(n) for n in sorted(sizes, reverse=True))} tensors"


def group_size_error(rtype: int, base: str, sizes_by_rank: dict[int, set[int]]) -> str:
    """The error of a grouped collective whose ranks passed different numbers of tensors under one name,
    naming every rank and what it sent (upstream waits for the missing names forever)."""
    by_sizes: dict[frozenset[int], list[int]] = {}
    for rank in sorted(sizes_by_rank):
        by_sizes.setdefault(frozenset(sizes_by_rank[rank]), []).append(rank)
    parts = [f"{_ranks_text(ranks)} sent {_tensors_text(sizes)}" for sizes, ranks in by_sizes.items()]
    said = ", ".join(parts[:-1]) + ", but " + parts[-1] if len(parts) > 1 else parts[0]
    return (f"Mismatched grouped {OP_DISPLAY[rtype]} sizes for {base}: {said}. Every rank must pass the same "
            "number of tensors to a grouped collective of one name.")


class GroupSizes:
    """The group sizes of one process set's bases: pending (from full requests) and cached.

    ``names``: pending member names that were noted -> (base, size); ``pending``: per base, how many noted
    names of each size are pending; ``cached``: per base, ``[size, entries]`` of its cached members (one size
    at a time); ``varying``: bases seen with two sizes, never cached again."""

    __slots__ = ("names", "pending", "cached", "varying")

    def __init__(self) -> None:
        self.names: dict[str, tuple[str, int]] = {}
        self.pending: dict[str, dict[int, int]] = {}
        self.cached: dict[str, list[int]] = {}
        self.varying: set[str] = set()

    def note(self, name: str, base: str, size: int) -> bool:
        """A member name arrived in a full request (or a hit on an evicted entry): count it among the base's
        pending names.  Returns whether the base must be checked (another size of it is pending or cached)."""
        sizes = self.pending.get(base)
        if sizes is None:
            sizes = self.pending[base] = {}
        if name not in self.names:  # (another rank's request named it first)
            self.names[name] = (base, size)
            sizes[size] = sizes.get(size, 0) + 1
        cached = self.cached.get(base)
        return len(sizes) > 1 or (cached is not None and cached[0] != size)

    def settled(self, name: str) -> tuple[str, int] | None:
        """A pending name completed or failed: stop counting it.  Returns its (base, size) when it was noted."""
        group = self.names.pop(name, None)
        if group is None:
            return None
        base, size = group
        sizes = self.pending[base]
        if sizes[size] > 1:
            sizes[size] -= 1
        else:
            del sizes[size]
            if not sizes:
                del self.pending[base]
        return group

    def may_cache(self, group: tuple[str, int]) -> bool:
        """A base is cached with one size at a time, and never once it was seen with two (see the module)."""
        base, size = group
        cached = self.cached.get(base)
        return base not in self.varying and (cached is None or cached[0] == size)

    def entry_cached(self, group: tuple[str, int]) -> None:
        """A member of ``group`` entered the cache (``may_cache`` said it may)."""
        counted = self.cached.get(group[0])
        if counted is None:
            self.cached[group[0]] = [group[1], 1]
        else:
            counted[1] += 1

    def entry_evicted(self, group: tuple[str, int]) -> None:
        """A cached member of ``group`` left the cache."""
        counted = self.cached.get(group[0])
        if counted is not None:
            counted[1] -= 1
            if counted[1] <= 0:
                del self.cached[group[0]]

    def vary(self, base: str) -> tuple[set[int], list[str]] | None:
        """Start checking ``base``: None when fewer than two sizes of it are pending or cached; otherwise mark
        it varying (never cached again) and return its sizes and the names of its cached members, which the
        caller evicts, since their later hits would bypass the check."""
        sizes = set(self.pending.get(base, ()))
        cached = self.cached.get(base)
        if cached is not None:
            sizes.add(cached[0])
        if len(sizes) < 2:
            return None
        if ".noname." not in base:  # (an unnamed base is never cached, nor repeated)
            self.varying.add(base)
        return sizes, _member_names(base, cached[0]) if cached is not None else []

    @staticmethod
    def mismatch(base: str, sizes: set[int], pending: Mapping[str, _Waiting], ranks: list[int],
                 joined: Collection[int]) -> tuple[list[str], str] | None:
        """The pending names of ``base`` (of ``sizes``, from :meth:`vary`) that fail, with their error: when
        two ranks sent groups of no common size, and every member but the joined ones sent its part (a member
        that never does is the stall inspector's; the base is checked again when its part arrives)."""
        found: list[tuple[str, _Waiting]] = []
        by_rank: dict[int, set[int]] = {}
        for n in sorted(sizes):
            for name in _member_names(base, n):
                waiting = pending.get(name)
                if waiting is not None:
                    found.append((name, waiting))
                    for r in waiting.requests:
                        by_rank.setdefault(r, set()).add(n)
        if not group_sizes_disagree(by_rank):
            return None
        if any(r not in by_rank and r not in joined for r in ranks):
            return None
        rtype = next(iter(found[0][1].requests.values())).type
        return [name for name, _ in found], group_size_error(rtype, base, by_rank)
