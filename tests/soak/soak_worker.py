"""The soak job: thousands of random collectives on every rank, each result checked against numpy.

    python -m horovod.runner -np 4 python tests/soak/soak_worker.py OUT_DIR SEED STEPS

Every rank draws the same schedule from ``random.Random(SEED)``: per step a collective (allreduce with every
op and pre/post-scaling, in-place and grouped; allgather with a rank-dependent first dimension; broadcast from
a random root; alltoall with random splits; reducescatter; barrier; broadcast_object/allgather_object), a
dtype, a size (0 or 1 element up to 1 MiB, log-uniform, mostly small), a process set (global, static or
dynamic; only members call it) and sync or async (a batch in flight, synchronized in a random order).  Now
and then a step adds or removes a dynamic process set, runs a join round (some ranks join while the others
still allreduce), submits mismatched requests (every member must get the error and carry on), or re-inits
Horovod (``shutdown(); init()``) and checks that the old generation left no socket, memfd or thread behind.

Inputs come from ``parallel_util.data`` keyed by (seed, step, op), so every rank knows every member's input
and computes the expected result itself.  Integers are small enough to be exact in every dtype and order;
Average results of floating dtypes are compared within a few ulps.  On failure the rank prints the seed,
the step and the operation and exits 1; ``SOAK_DEBUG=1`` prints every step.  At the end each rank writes
``OUT_DIR/rank<r>.json`` (counts per kind and dtype, leak census); rank 0 prints the summary.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import random
import sys
import threading
import time
import traceback

import numpy as np
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "parallel"))
from parallel_util import (  # noqa: E402
    ALL_DTYPES,
    BF16,
    allreduce_expected,
    assert_same,
    data,
    launcher_rank_size,
    reducescatter_rows,
)

import horovod.numpy as hvd  # noqa: E402
from horovod.common import basics  # noqa: E402

OUT, SEED, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
RANK, SIZE = launcher_rank_size()
DEBUG = os.environ.get("SOAK_DEBUG") == "1"
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

SUM, AVG, MIN, MAX, PROD = hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product
OP_NAMES = {SUM: "sum", AVG: "avg", MIN: "min", MAX: "max", PROD: "prod"}
MAX_BYTES = 1 << 20
# Largest integer magnitude each dtype holds exactly (sums, products and scalings stay below it).
EXACT = {"int8": 127, "uint8": 255, "int16": 32767, "uint16": 65535, "float16": 2048, "bfloat16": 256}
GLOBAL = tuple(range(SIZE))

# Kinds of step and their weights.
KINDS = {"allreduce": 22, "grouped_allreduce": 6, "allgather": 9, "grouped_allgather": 2, "broadcast": 9,
         "alltoall": 7, "reducescatter": 6, "grouped_reducescatter": 2, "barrier": 3, "objects": 3,
         "batch": 16, "repeat": 10, "process_set": 1.5, "mismatch": 1.0, "join": 1.0, "reinit": 0.25}
BATCHABLE = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
             "reducescatter", "grouped_reducescatter"]


def _static_sets() -> list[tuple[int, ...]]:
    sets = [tuple(range(0, SIZE, 2)), tuple(range(1, SIZE, 2))]
    if SIZE > 2:
        sets.append(tuple(range(SIZE - 1)))
    return [s for s in sets if s]


STATIC = _static_sets()
STATIC_OBJS = [hvd.ProcessSet(list(s)) for s in STATIC]
# Dynamic candidates: every other subset of the ranks.
POOL = [s for k in range(1, SIZE) for s in itertools.combinations(range(SIZE), k) if s not in STATIC]


class Soak:
    """The shared schedule and this rank's part of it."""

    def __init__(self) -> None:
        self.rng = random.Random(SEED)
        self.dynamic: dict[tuple[int, ...], hvd.ProcessSet] = {}
        self.history: list[dict] = []  # earlier single-op specs, replayed by "repeat" (response cache hits)
        self.counts: collections.Counter[str] = collections.Counter()
        self.dtypes: collections.Counter[str] = collections.Counter()
        self.step = 0
        self.current: object = None
        self.generations = 0
        self.census_before_init = census()
        self.census_after_shutdown: list[dict] = []
        # Every generation's TCP connections and abstract socket names: the test checks none outlives the job.
        self.tcp: set[tuple[str, int, str, int]] = set()
        self.unix_names: set[str] = set()

    # ------------------------------------------------------------------ shared draws
    def sets(self) -> list[tuple[int, ...]]:
        return [GLOBAL, *STATIC, *self.dynamic]

    def ps(self, members: tuple[int, ...]) -> hvd.ProcessSet:
        if members == GLOBAL:
            return hvd.global_process_set
        if members in STATIC:
            return STATIC_OBJS[STATIC.index(members)]
        return self.dynamic[members]

    def draw_set(self) -> tuple[int, ...]:
        return GLOBAL if self.rng.random() < 0.4 else self.rng.choice(self.sets())

    def draw_dtype(self, kind: str) -> np.dtype:
        choices = [d for d in ALL_DTYPES if not (d == np.bool_ and kind == "reducescatter")]  # Sum/Average only
        return self.rng.choice(choices)

    def draw_count(self, itemsize: int) -> int:
        """Elements: 0 or 1 now and then, else log-uniform bytes up to 1 MiB, weighted to small."""
        r = self.rng.random()
        if r < 0.06:
            return 0
        if r < 0.12:
            return 1
        return max(1, int(2 ** (20 * self.rng.random() ** 1.7)) // itemsize)

    def draw_trailing(self, count: int) -> tuple[int, ...]:
        r = self.rng.random()
        if r < 0.6 or count < 8:
            return ()
        if r < 0.9:
            return (self.rng.choice([2, 3, 4, 5]),)
        return (self.rng.choice([2, 3]), 2)

    def draw_scales(self, op: int, dtype: np.dtype) -> tuple[float, float]:
        if dtype == np.bool_ or self.rng.random() < 0.6:
            return 1.0, 1.0
        # Powers of two keep products and averages exact; 1.5 only where a sum of small ints stays exact.
        pre = self.rng.choice([0.5, 2.0, 1.0] + ([1.5] if op in (SUM, AVG, MIN, MAX) else []))
        if op == PROD:
            pre = self.rng.choice([1.0, 2.0])
        post = self.rng.choice([0.25, 0.5, 1.0, 2.0])
        return pre, post

    def draw_name(self, kind: str) -> str | None:
        r = self.rng.random()
        if r < 0.15:
            return None  # auto-named: every member counts the set's unnamed ops alike
        return f"{kind}.{self.rng.randrange(3)}"

    @staticmethod
    def bound(dtype: np.dtype, op: int, n: int, pre: float, post: float) -> int:
        """Largest input magnitude whose reduction over ``n`` ranks stays exact in ``dtype``."""
        exact = EXACT.get(dtype.name, 1 << 20)
        if op == PROD:
            return max(1, min(2, int((exact / post) ** (1.0 / n) / pre)))
        return max(1, min(8, int(exact / (n * max(pre, 1.0) * max(post, 1.0)))))

    def plan(self, kind: str, members: tuple[int, ...], key, name: str | None) -> dict:
        """A spec: everything every rank needs to run the op and check it."""
        rng = self.rng
        n = len(members)
        spec: dict = {"kind": kind, "set": members, "key": key, "name": name}
        if kind in ("allreduce", "grouped_allreduce"):
            dtype = self.draw_dtype(kind)
            op = rng.choice([MIN, MAX] if dtype == np.bool_ else [SUM, AVG, MIN, MAX, PROD])
            pre, post = self.draw_scales(op, dtype)
            k = 1 if kind == "allreduce" else rng.randint(1, 5)
            shapes = []
            for _ in range(k):
                count = self.draw_count(dtype.itemsize) // (k if k > 1 else 1)
                trailing = self.draw_trailing(count)
                width = math.prod(trailing)
                shapes.append(() if count == 1 and not trailing and rng.random() < 0.5 else
                              (count // width, *trailing))
            spec.update(dtype=dtype, op=op, pre=pre, post=post, shapes=shapes,
                        hi=self.bound(dtype, op, n, pre, post), inplace=kind == "allreduce" and rng.random() < 0.2)
        elif kind in ("allgather", "grouped_allgather"):
            dtype = self.draw_dtype(kind)
            k = 1 if kind == "allgather" else rng.randint(1, 4)
            parts = []
            for _ in range(k):
                count = self.draw_count(dtype.itemsize) // (n * k)
                trailing = self.draw_trailing(count)
                rows = max(1, count // max(1, math.prod(trailing)))
                parts.append({"trailing": trailing, "dims": [rng.randint(0, rows) for _ in members]})
            spec.update(dtype=dtype, parts=parts)
        elif kind == "broadcast":
            dtype = self.draw_dtype(kind)
            count = self.draw_count(dtype.itemsize)
            trailing = self.draw_trailing(count)
            shape = () if count == 1 and rng.random() < 0.5 else (count // max(1, math.prod(trailing)), *trailing)
            spec.update(dtype=dtype, shape=shape, root=rng.choice(members), inplace=rng.random() < 0.3)
        elif kind == "alltoall":
            dtype = self.draw_dtype(kind)
            count = self.draw_count(dtype.itemsize) // max(1, n * n)
            trailing = self.draw_trailing(count)
            m = max(1, count // max(1, math.prod(trailing)))
            with_splits = rng.random() < 0.75
            splits = [[rng.randint(0, m) if with_splits else m for _ in members] for _ in members]
            spec.update(dtype=dtype, trailing=trailing, splits=splits, with_splits=with_splits)
        elif kind in ("reducescatter", "grouped_reducescatter"):
            dtype = self.draw_dtype("reducescatter")
            op = rng.choice([SUM, AVG])
            pre, post = self.draw_scales(op, dtype)
            k = 1 if kind == "reducescatter" else rng.randint(1, 4)
            shapes = []
            for _ in range(k):
                count = self.draw_count(dtype.itemsize) // k
                trailing = self.draw_trailing(count)
                dim0 = count // max(1, math.prod(trailing))
                if rng.random() < 0.2:
                    dim0 = rng.randint(0, n)  # fewer rows than members: some get none
                shapes.append((dim0, *trailing))
            spec.update(dtype=dtype, op=op, pre=pre, post=post, shapes=shapes, hi=self.bound(dtype, op, n, pre, post))
        elif kind == "objects":
            spec.update(root=rng.choice(members), which=rng.choice(["broadcast", "allgather", "both"]))
        return spec

    # ------------------------------------------------------------------ the schedule
    def run(self) -> None:
        hvd.init(process_sets=STATIC_OBJS)
        self.generations += 1
        self.record_endpoints()
        weights = list(KINDS.values())
        kinds = list(KINDS)
        t0 = time.monotonic()
        for self.step in range(STEPS):
            kind = self.rng.choices(kinds, weights)[0]
            if kind == "repeat" and not self.history:
                kind = "allreduce"
            if self.step == STEPS // 2 and not self.counts["reinit"]:
                kind = "reinit"  # at least one per run
            self.current = kind
            if DEBUG and RANK == 0:
                print(f"step {self.step}: {kind}", flush=True)
            getattr(self, f"step_{kind}", self.step_single)(kind)
        self.current = "final check"
        steps = hvd.allgather_object(self.step, name="final")
        assert steps == [STEPS - 1] * SIZE, f"ranks ended at different steps: {steps}"
        elapsed = time.monotonic() - t0
        hvd.shutdown()
        self.check_no_leaks()
        summary = {"rank": RANK, "seed": SEED, "steps": STEPS, "seconds": round(elapsed, 1),
                   "kinds": dict(sorted(self.counts.items())), "dtypes": dict(sorted(self.dtypes.items())),
                   "generations": self.generations, "census_before_init": self.census_before_init,
                   "census_after_shutdown": self.census_after_shutdown, "pid": os.getpid(),
                   "tcp": sorted(self.tcp), "unix_names": sorted(self.unix_names)}
        with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
            json.dump(summary, f)
        if RANK == 0:
            print("SOAK SUMMARY " + json.dumps(summary), flush=True)

    def count(self, spec: dict) -> None:
        self.counts[spec["kind"]] += 1
        if "dtype" in spec:
            self.dtypes[str(spec["dtype"])] += 1

    def step_single(self, kind: str) -> None:
        members = self.draw_set()
        spec = self.plan(kind, members, (SEED, self.step, 0), self.draw_name(kind))
        if kind not in ("barrier", "objects"):
            self.history.append(spec)
            del self.history[:-50]
        if RANK in members:
            self.current = spec
            finish = self.submit(spec)
            finish()
            self.count(spec)

    def step_repeat(self, _kind: str) -> None:
        """An earlier op again, same name and parameters, new data: a response cache hit."""
        spec = dict(self.rng.choice(self.history), key=(SEED, self.step, 0))
        if spec["set"] not in self.sets():
            return
        if RANK in spec["set"]:
            self.current = spec
            self.submit(spec)()
            self.counts["repeat"] += 1

    def step_batch(self, _kind: str) -> None:
        """Several ops in flight on several sets, synchronized in a random order."""
        specs = []
        for j in range(self.rng.randint(2, 8)):
            kind = self.rng.choice(BATCHABLE)
            specs.append(self.plan(kind, self.draw_set(), (SEED, self.step, j), f"batch{j}.{kind}"))
        order = list(range(len(specs)))
        self.rng.shuffle(order)
        polls = self.rng.random() < 0.3
        mine = {j: s for j, s in enumerate(specs) if RANK in s["set"]}
        self.current = specs
        pending = {j: self.submit(s) for j, s in mine.items()}
        if polls:
            for j in mine:
                hvd.poll(pending[j].handle)  # type: ignore[attr-defined]
        for j in order:
            if j in pending:
                self.current = specs[j]
                pending[j]()
                self.count(specs[j])
        self.counts["batch"] += 1

    def step_process_set(self, _kind: str) -> None:
        """Add or remove a dynamic set (collective on every rank), then check the tables agree."""
        free = [s for s in POOL if s not in self.dynamic]
        if self.dynamic and (len(self.dynamic) >= 3 or self.rng.random() < 0.4):
            members = self.rng.choice(list(self.dynamic))
            ps = self.dynamic.pop(members)
            assert hvd.remove_process_set(ps) is True
            assert ps.process_set_id is None
            if RANK in members:
                try:
                    hvd.allreduce(np.ones(1), process_set=ps)
                except ValueError as e:
                    assert "Process set provided does not exist" in str(e), e
                else:
                    raise AssertionError("an allreduce on a removed process set did not fail")
            self.counts["ps.remove"] += 1
        elif free:
            members = self.rng.choice(free)
            ps = hvd.add_process_set(list(members))
            assert ps.process_set_id is not None and ps.ranks == list(members)
            self.dynamic[members] = ps
            self.counts["ps.add"] += 1
        if self.rng.random() < 0.3:  # a duplicate is refused on every rank, and nothing changes
            existing = self.rng.choice([*STATIC, *self.dynamic])
            try:
                hvd.add_process_set(list(existing))
            except ValueError as e:
                assert str(e).startswith("Attempted to add a duplicate process set"), e
            else:
                raise AssertionError(f"adding a duplicate of {existing} did not fail")
        from horovod.common.basics import _get_process_set_ids_and_ranks

        table = sorted((k, tuple(v)) for k, v in _get_process_set_ids_and_ranks().items())
        tables = hvd.allgather_object(table, name="ps.table")
        assert all(t == table for t in tables), f"process set tables differ: {tables}"
        assert {v for _, v in table} == set(self.sets()), (table, self.sets())

    def step_mismatch(self, _kind: str) -> None:
        """The last member sends another dtype or shape: every member gets upstream's error, then carries on."""
        members = self.draw_set()
        if len(members) < 2:
            return
        what = self.rng.choice(["dtype", "shape"])
        name = f"mismatch.{self.step}"
        if RANK not in members:
            return
        odd = RANK == members[-1]
        x = np.ones(5 if odd and what == "shape" else 4, np.float32 if odd and what == "dtype" else np.float64)
        self.current = {"kind": "mismatch", "what": what, "set": members}
        try:
            hvd.allreduce(x, op=SUM, name=name, process_set=self.ps(members))
        except hvd.HorovodInternalError as e:
            expected = "Mismatched data types" if what == "dtype" else "Mismatched ALLREDUCE tensor shapes"
            assert expected in str(e), e
        else:
            raise AssertionError("mismatched allreduce did not fail")
        self.counts["mismatch"] += 1

    def step_join(self, _kind: str) -> None:
        """Some ranks join at once; the others allreduce (joined ranks count as zeros) and then join."""
        rng = self.rng
        early = set(rng.sample(range(SIZE), rng.randint(1, SIZE)))
        late = sorted(set(range(SIZE)) - early)
        specs = []
        for j in range(rng.randint(0, 4) if late else 0):
            kind = rng.choice(["allreduce", "grouped_allreduce"])
            specs.append(self.plan(kind, GLOBAL, (SEED, self.step, j), f"join{j}.{kind}"))
        asynchronous = rng.random() < 0.5
        self.current = {"kind": "join", "early": sorted(early), "ops": specs}
        if RANK in late:
            if asynchronous:
                pending = [self.submit(s, joined=early) for s in specs]
                for finish in pending:
                    finish()
            else:
                for s in specs:
                    self.submit(s, joined=early)()
        last = hvd.join()
        if len(late) == 1 and specs:
            assert last == late[0], (last, late)
        elif late and specs:
            assert last in late, (last, late)
        assert 0 <= last < SIZE
        lasts = hvd.allgather_object(last, name="join.last")
        assert lasts == [last] * SIZE, lasts
        self.counts["join"] += 1
        self.counts["join.allreduce"] += len(specs) if RANK in late else 0

    def step_reinit(self, _kind: str) -> None:
        """shutdown(); init(): the old generation leaves nothing behind; static and dynamic sets come back."""
        self.current = "reinit"
        # shutdown() ends the generation for every rank (as upstream): a rank must not get there while the
        # others still run collectives of sets it is not in.
        hvd.barrier()
        hvd.shutdown()
        self.check_no_leaks()
        hvd.init(process_sets=STATIC_OBJS)
        self.generations += 1
        self.record_endpoints()
        assert hvd.is_initialized()
        assert [ps.process_set_id for ps in STATIC_OBJS] == list(range(1, len(STATIC) + 1))
        gens = hvd.allgather(np.array([basics.generation()], np.int64), name="reinit.generation")
        assert gens.tolist() == [basics.generation()] * SIZE, f"generations differ: {gens.tolist()}"
        wanted = self.rng.sample(POOL, self.rng.randint(0, min(3, len(self.dynamic) + 1)))
        self.dynamic = {}
        self.history = []
        for members in wanted:
            self.dynamic[members] = hvd.add_process_set(list(members))
        self.counts["reinit"] += 1

    # ------------------------------------------------------------------ one op: submit now, check later
    def submit(self, spec: dict, joined: set[int] = frozenset()):
        """Submit this rank's part of ``spec`` asynchronously; returns a callable that waits and checks."""
        kind, members = spec["kind"], spec["set"]
        ps = self.ps(members)
        key, name = spec["key"], spec["name"]
        me = members.index(RANK)
        n = len(members)

        def inputs(shape, dtype, hi=8, sub=0):
            return {r: np.array(data((key, sub), r, shape, dtype, low=-hi, high=hi)) for r in members}

        if kind in ("allreduce", "grouped_allreduce"):
            dtype, op, pre, post = spec["dtype"], spec["op"], spec["pre"], spec["post"]
            xss = [inputs(shape, dtype, spec["hi"], i) for i, shape in enumerate(spec["shapes"])]
            for xs in xss:
                for r in joined:
                    xs[r] = np.zeros_like(xs[r])  # a joined rank contributes zeros
            mine = [xs[RANK].copy() for xs in xss]  # in place: the expected values keep the inputs
            if kind == "allreduce" and spec["inplace"]:
                h = hvd.allreduce_async_(mine[0], name=name, op=op, prescale_factor=pre, postscale_factor=post,
                                         process_set=ps)
            elif kind == "allreduce":
                h = hvd.allreduce_async(mine[0], name=name, op=op, prescale_factor=pre, postscale_factor=post,
                                        process_set=ps)
            else:
                h = hvd.grouped_allreduce_async(mine, name=name, op=op, prescale_factor=pre,
                                                postscale_factor=post, process_set=ps)

            def finish():
                out = hvd.synchronize(h)
                outs = out if kind == "grouped_allreduce" else [out]
                assert len(outs) == len(xss)
                for xs, got in zip(xss, outs):
                    expected = allreduce_expected([xs[r] for r in members], op, pre, post)
                    check(got, expected, approx=op == AVG)
                if kind == "allreduce" and spec["inplace"]:
                    check(mine[0], allreduce_expected([xss[0][r] for r in members], op, pre, post),
                          approx=op == AVG)

        elif kind in ("allgather", "grouped_allgather"):
            dtype = spec["dtype"]
            parts = []
            for i, part in enumerate(spec["parts"]):
                xs = {r: np.array(data((key, i), r, (part["dims"][j], *part["trailing"]), dtype))
                      for j, r in enumerate(members)}
                parts.append(xs)
            if kind == "allgather":
                h = hvd.allgather_async(parts[0][RANK], name=name, process_set=ps)
            else:
                h = hvd.grouped_allgather_async([xs[RANK] for xs in parts], name=name, process_set=ps)

            def finish():
                out = hvd.synchronize(h)
                outs = out if kind == "grouped_allgather" else [out]
                for xs, got in zip(parts, outs):
                    assert_same(got, np.concatenate([xs[r] for r in members]))

        elif kind == "broadcast":
            dtype, root = spec["dtype"], spec["root"]
            x = np.array(data(key, RANK, spec["shape"], dtype))  # overwritten when in place
            root_x = np.array(data(key, root, spec["shape"], dtype))
            if spec["inplace"]:
                h = hvd.broadcast_async_(x, root, name=name, process_set=ps)
            else:
                h = hvd.broadcast_async(x, root, name=name, process_set=ps)

            def finish():
                assert_same(hvd.synchronize(h), root_x)
                if spec["inplace"]:
                    assert_same(x, root_x)

        elif kind == "alltoall":
            dtype, splits = spec["dtype"], spec["splits"]
            xs = {r: np.array(data(key, r, (sum(splits[j]), *spec["trailing"]), dtype)) for j, r in enumerate(members)}
            h = hvd.alltoall_async(xs[RANK], splits=np.array(splits[me], np.int32) if spec["with_splits"] else None,
                                   name=name, process_set=ps)

            def finish():
                out = hvd.synchronize(h)
                blocks = []
                for j, r in enumerate(members):
                    start = sum(splits[j][:me])
                    blocks.append(xs[r][start:start + splits[j][me]])
                if spec["with_splits"]:
                    out, received = out
                    np.testing.assert_array_equal(received, [splits[j][me] for j in range(n)])
                assert_same(out, np.concatenate(blocks))

        elif kind in ("reducescatter", "grouped_reducescatter"):
            dtype, op, pre, post = spec["dtype"], spec["op"], spec["pre"], spec["post"]
            xss = [inputs(shape, dtype, spec["hi"], i) for i, shape in enumerate(spec["shapes"])]
            if kind == "reducescatter":
                h = hvd.reducescatter_async(xss[0][RANK], name=name, op=op, process_set=ps, prescale_factor=pre,
                                            postscale_factor=post)
            else:
                h = hvd.grouped_reducescatter_async([xs[RANK] for xs in xss], name=name, op=op, process_set=ps,
                                                    prescale_factor=pre, postscale_factor=post)

            def finish():
                out = hvd.synchronize(h)
                outs = out if kind == "grouped_reducescatter" else [out]
                for xs, got in zip(xss, outs):
                    full = allreduce_expected([xs[r] for r in members], op, pre, post)
                    rows = reducescatter_rows(full.shape[0], n)
                    start = sum(rows[:me])
                    check(got, full[start:start + rows[me]], approx=op == AVG)

        elif kind == "barrier":
            hvd.barrier(process_set=ps)

            def finish():
                pass

        elif kind == "objects":
            def obj(r):
                return {"seed": SEED, "step": self.step, "from": r, "payload": list(range(r + self.step % 7))}

            def finish():
                if spec["which"] in ("broadcast", "both"):
                    got = hvd.broadcast_object(obj(RANK), root_rank=spec["root"], name=name, process_set=ps)
                    assert got == obj(spec["root"]), got
                if spec["which"] in ("allgather", "both"):
                    got = hvd.allgather_object(obj(RANK), name=name, process_set=ps)
                    assert got == [obj(r) for r in members], got
        else:
            raise AssertionError(f"unknown kind {kind}")
        if kind not in ("barrier", "objects"):
            finish.handle = h  # type: ignore[attr-defined]
        return finish

    # ------------------------------------------------------------------ leaks
    def record_endpoints(self) -> None:
        me = psutil.Process()
        for c in me.net_connections(kind="inet"):
            if c.raddr:
                self.tcp.add((*c.laddr, *c.raddr))
        for c in me.net_connections(kind="unix"):
            if c.laddr:
                self.unix_names.add(c.laddr)

    def check_no_leaks(self) -> None:
        """After shutdown(): no socket, memfd or thread of the old generation (within 5 s), and nothing
        growing across generations."""
        deadline = time.monotonic() + 5.0
        while True:
            now = census()
            leaked = {k: v for k, v in now.items()
                      if k in ("socket", "memfd", "memfd_maps", "threads") and v > self.census_before_init.get(k, 0)}
            grown = {k: v for k, v in now.items()
                     if self.census_after_shutdown and v > self.census_after_shutdown[0].get(k, 0)}
            if not leaked and not grown:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"after shutdown (generation {basics.generation()}): leaked {leaked}, "
                                     f"grown {grown}; before init {self.census_before_init}, after the first "
                                     f"shutdown {self.census_after_shutdown[:1]}")
            time.sleep(0.05)
        self.census_after_shutdown.append(now)


def census() -> dict[str, int]:
    """This process's descriptors by kind, memfd mappings and threads."""
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the directory listing's own descriptor
        if link.startswith(("socket:", "pipe:")):
            kinds[link.split(":", 1)[0]] += 1
        elif link.startswith("anon_inode:"):
            kinds[link] += 1
        elif link.startswith("/memfd:"):
            kinds["memfd"] += 1
    with open("/proc/self/maps") as f:
        kinds["memfd_maps"] = sum(1 for line in f if "/memfd:" in line)
    kinds["threads"] = threading.active_count()
    return dict(kinds)


def check(actual: np.ndarray, expected: np.ndarray, approx: bool = False) -> None:
    """Exact, except an Average of a floating dtype: within a few ulps of the numpy result."""
    if approx and expected.dtype.kind == "f" or approx and expected.dtype == BF16:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape,
                                                                                   expected.dtype, expected.shape)
        eps = 2.0 ** -7 if expected.dtype == BF16 else float(np.finfo(expected.dtype).eps)
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=4 * eps, atol=0)
    else:
        assert_same(actual, expected)


def describe(current) -> str:
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, np.dtype):
            return str(x)
        return x
    return json.dumps(plain(current), default=str)


def main() -> int:
    soak = Soak()
    try:
        soak.run()
    except BaseException:
        print(f"SOAK FAILURE rank={RANK} seed={SEED} step={soak.step} op={describe(soak.current)}\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
