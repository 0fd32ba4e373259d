"""Control frames to peers, sent without ever blocking the sender.

Rank 0 reads its control channels only between collectives.  A rank that blocked in ``sendall`` because its
socket buffer is full (rank 0 is inside a collective and not reading) could never reach that collective
itself: both wait for each other until the op timeout.  Many small frames make it happen (one request frame
per enqueued tensor, each carrying a 16 KiB tensor inline, at ``HOROVOD_CYCLE_TIME=0``).  So every control
frame goes through an :class:`Outbox`: what the socket does not take at once waits here, in order, and is
sent when the socket is writable again -- the engine watches for that (``watch``) and calls :meth:`flush`.
A frame is written whole or queued whole behind the rest, so frames never interleave.
"""

from __future__ import annotations

import collections
import select
import threading
import time
from collections.abc import Callable, Collection, Mapping

from horovod.transport.wire import Channel, frame_parts

__all__ = ["Outbox"]


class Outbox:
    """Per-peer queues of frame bytes not yet taken by the socket.

    ``channels`` maps a peer's rank to its channel (the mapping may lose entries when peers close);
    ``watch(channel, on)`` is called when a peer's queue becomes non-empty (``on=True``: poll the channel
    for writability) or empty again.  Safe to use from several threads (the engine's rounds, the keep-alive
    thread); each channel is only written under the outbox's lock.
    """

    def __init__(self, channels: Mapping[int, Channel], watch: Callable[[Channel, bool], None]) -> None:
        self._channels = channels
        self._watch = watch
        self._lock = threading.Lock()
        self._queued: dict[int, collections.deque[memoryview]] = {}
        # Per peer, bytes handed to send() and bytes its socket took (or that a broken connection dropped),
        # ever: drain(until=...) waits for the frames up to a point of the stream, not for later ones.
        self._accepted: collections.Counter[int] = collections.Counter()
        self._written: collections.Counter[int] = collections.Counter()

    def send(self, peer: int, kind: int, payload: bytes | bytearray | memoryview = b"") -> int:
        """Send a frame to ``peer`` now as far as its socket takes it; the rest waits behind what waits.

        Returns where the frame ends in the bytes sent to ``peer`` ever (``drain(until=...)`` waits for it).
        Raises the channel's error (``PeerFailure``, a ConnectionError) when the connection is broken.
        """
        channel = self._channels[peer]
        parts = frame_parts(channel.peer, kind, payload)
        with self._lock:
            self._accepted[peer] += sum(part.nbytes for part in parts)
            end = self._accepted[peer]
            queue = self._queued.get(peer)
            if queue:
                queue.extend(parts)
                return end
            queue = collections.deque(parts)
            self._write(peer, channel, queue)
            if queue:
                self._queued[peer] = queue
                self._watch(channel, True)
            return end

    def flush(self, peer: int) -> None:
        """Send what the socket of ``peer`` takes now (its channel polled writable).  A broken connection
        drops the queue: the engine learns of it from the channel's reading side."""
        with self._lock:
            queue = self._queued.get(peer)
            channel = self._channels.get(peer)
            if not queue or channel is None:
                self._forget(peer, channel)
                return
            try:
                self._write(peer, channel, queue)
            except (ConnectionError, OSError):
                queue.clear()
                self._written[peer] = self._accepted[peer]  # dropped: nobody waits for it any more
            if not queue:
                self._forget(peer, channel)

    def backlog(self, peer: int) -> int:
        """Bytes queued for ``peer``."""
        with self._lock:
            return sum(v.nbytes for v in self._queued.get(peer, ()))

    def waiting(self) -> bool:
        """Whether any bytes wait (cheap: for a check on every collective)."""
        return bool(self._queued)

    def drain(self, timeout: float, peers: Collection[int] | None = None,
              until: Mapping[int, int] | None = None) -> list[int]:
        """Wait up to ``timeout`` s until nothing waits for ``peers`` (None: any peer) -- with ``until``
        (peer -> what :meth:`send` returned), until each of them took its bytes up to there, however many
        frames wait behind -- sending to every peer whose socket takes bytes meanwhile (one peer's frame may
        be what another waits for).  Returns the peers of ``peers`` still waiting ([] when done)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                waiting = [p for p, q in self._queued.items() if q and p in self._channels]
                left = [p for p in waiting if (peers is None or p in peers)
                        and (until is None or self._written[p] < until.get(p, 0))]
            remaining = deadline - time.monotonic()
            if not left or remaining <= 0:
                return left
            poller = select.poll()
            fds = {}
            for p in waiting:
                fd = self._channels[p].fileno()
                fds[fd] = p
                poller.register(fd, select.POLLOUT)
            for fd, _ in poller.poll(remaining * 1000.0):
                self.flush(fds[fd])

    def _write(self, peer: int, channel: Channel, queue: collections.deque[memoryview]) -> None:
        """Write from the head of ``queue`` until the socket would block; sent bytes leave the queue."""
        while queue:
            view = queue[0]
            try:
                sent = channel.try_send(view)
            except OSError as e:
                raise channel._fail(e, "sending a frame") from e
            if sent is None:
                return
            self._written[peer] += sent
            if sent < view.nbytes:
                queue[0] = view[sent:]
            else:
                queue.popleft()

    def _forget(self, peer: int, channel: Channel | None) -> None:
        self._written[peer] = self._accepted[peer]  # all taken, or (no channel) dropped with the peer
        if self._queued.pop(peer, None) is not None and channel is not None:
            self._watch(channel, False)
