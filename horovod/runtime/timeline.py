"""Upstream's Chrome-trace timeline, written by rank 0 only.

A writer thread appends records; after every record the file ends with ``]`` so it is valid JSON at any
moment (the writer seeks back over the ``]`` before appending).  Negotiation phases are recorded by the
coordinator (which lives on rank 0), execution phases by rank 0's engine.  A tensor that stands for several
(horovod.torch's gradient buckets) is drawn as each of its members (:meth:`Timeline.show_as`), so the timeline
still has a row per gradient, as upstream's does.  Which rows a name stands for is known locally only once this
rank has built it (a bucket is registered before rank 0 submits it), so the negotiation events of a name another
rank submitted first are held, with their timestamps, until rank 0's own request for it or the negotiation's end.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

from horovod.runtime.messages import OP_DISPLAY

__all__ = ["Timeline"]

log = logging.getLogger(__name__)


class Timeline:
    """Thread-safe recorder; ``start(path)``/``stop()`` switch files (dynamic timeline)."""

    def __init__(self, mark_cycles: bool = False, rank: int = 0) -> None:
        self.mark_cycles = mark_cycles
        self.rank = rank  # the rank whose own requests settle a name's rows (the coordinator's)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pids: dict[str, int] = {}
        self._open: dict[str, list[str]] = {}  # name -> stack of open activities
        self._members: dict[str, tuple[str, ...]] = {}  # a bucket's engine name -> the names it is drawn as
        self._held: dict[str, list[tuple]] = {}  # name -> negotiation events recorded before its rows were known
        self._start_us = 0.0
        self._file = None
        self._active = False
        self._thread = threading.Thread(target=self._writer, name="horovod-timeline", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- control (any thread)
    def start(self, path: str, mark_cycles: bool | None = None) -> None:
        """Switch to a new file; returns once the writer has switched.

        Raises:
            OSError: the file cannot be written (nothing is recorded until a start that succeeds).
        """
        if mark_cycles is not None:
            self.mark_cycles = mark_cycles
        done = threading.Event()
        failure: list[OSError] = []
        self._queue.put(("open", (path, failure), done))
        done.wait()
        if failure:
            raise failure[0]

    def stop(self) -> None:
        done = threading.Event()
        self._queue.put(("close", None, done))
        done.wait()

    def close(self) -> None:
        self.stop()
        self._queue.put(None)
        self._thread.join(timeout=5)

    @property
    def active(self) -> bool:
        return self._active

    def show_as(self, name: str, members: tuple[str, ...]) -> None:
        """Draw every event of the engine tensor ``name`` on the rows of ``members`` instead of its own."""
        self._members[name] = tuple(members)

    def _rows(self, name: str) -> tuple[str, ...]:
        return self._members.get(name) or (name,)

    # -------------------------------------------------------------- events (engine thread)
    def _ts(self) -> int:
        return int(time.time() * 1e6 - self._start_us)

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def _emit(self, record: dict) -> None:
        self._queue.put(("rec", record, None))

    def negotiate_start(self, name: str, request_type: int) -> None:
        if self._active:
            activity = "NEGOTIATE_" + OP_DISPLAY.get(request_type, str(request_type))
            if name not in self._members:  # rows unknown until this rank's own request: hold
                self._held.setdefault(name, []).append(("begin", activity, self._ts()))
                return
            for row in self._rows(name):
                self._begin(row, activity)

    def negotiate_rank_ready(self, name: str, rank: int, request_type: int | None = None) -> None:
        if self._active:
            held = self._held.get(name)
            if held is not None and rank != self.rank:
                held.append(("tick", rank, self._ts(), request_type))
                return
            self._release(name)
            self._tick(name, rank, self._ts(), request_type)

    def negotiate_end(self, name: str) -> None:
        self._release(name)
        self.end(name)

    def _release(self, name: str) -> None:
        """Write the held events of ``name`` on the rows it is now known to stand for."""
        held = self._held.pop(name, None)
        if held is None or not self._active:
            return
        for event in held:
            if event[0] == "begin":
                for row in self._rows(name):
                    self._begin(row, event[1], event[2])
            else:
                self._tick(name, *event[1:])

    def _tick(self, name: str, rank: int, ts: int, request_type: int | None) -> None:
        for row in self._rows(name):
            if request_type is not None and not self._open.get(row):
                # negotiation began before the timeline was switched on: open its bar now
                self._begin(row, "NEGOTIATE_" + OP_DISPLAY.get(request_type, str(request_type)), ts)
            self._emit({"ph": "X", "name": str(rank), "ts": ts, "pid": self._pid(row), "dur": 0})

    def begin(self, name: str, activity: str) -> None:
        if self._active:
            for row in self._rows(name):
                self._begin(row, activity)

    def end(self, name: str, args: dict | None = None) -> None:
        if self._active:
            for row in self._rows(name):
                self._end(row, args)

    def _begin(self, row: str, activity: str, ts: int | None = None) -> None:
        self._open.setdefault(row, []).append(activity)
        self._emit({"ph": "B", "name": activity, "ts": self._ts() if ts is None else ts, "pid": self._pid(row)})

    def _end(self, row: str, args: dict | None) -> None:
        stack = self._open.get(row)
        if stack:
            stack.pop()
        record = {"ph": "E", "ts": self._ts(), "pid": self._pid(row)}
        if args:
            record["args"] = args
        self._emit(record)

    def mark_cycle(self) -> None:
        if self._active and self.mark_cycles:
            self._emit({"ph": "i", "name": "CYCLE_START", "ts": self._ts(), "s": "g"})

    # -------------------------------------------------------------- writer thread
    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            kind, payload, done = item
            try:
                if kind == "open":
                    self._close_file()
                    path, failure = payload
                    try:
                        self._open_file(path)
                    except OSError as e:
                        self._close_file()
                        failure.append(e)
                elif kind == "close":
                    self._close_file()
                elif self._file is not None:
                    self._write(payload)
            except OSError as e:
                log.error("timeline write failed: %s", e)
            finally:
                if done is not None:
                    done.set()

    def _open_file(self, path: str) -> None:
        self._file = open(path, "wb")  # owned by the writer thread until _close_file
        self._start_us = time.time() * 1e6
        self._pids.clear()
        self._file.write(b"[\n")
        self._write({"name": "process_name", "ph": "M", "pid": 0,
                     "args": {"start_time_since_epoch_in_micros": int(self._start_us)}})
        self._write({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}})
        self._active = True

    def _write(self, record: dict) -> None:
        f = self._file
        f.seek(0, 2)
        pos = f.tell()
        if pos > 2:  # replace the closing "]" with ","
            f.seek(pos - 2)
            f.write(b",\n")
        f.write(json.dumps(record).encode() + b"\n]")
        f.flush()

    def _close_file(self) -> None:
        self._active = False
        if self._file is not None:
            self._file.close()
            self._file = None
