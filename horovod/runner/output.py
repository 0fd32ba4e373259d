"""Forwarding a worker's output to the launcher's console, line by line, with a rank prefix.

Each stream is read by its own thread in raw chunks, so a line ending in ``\\r`` (progress bars) or a last
line without a newline is forwarded as soon as it is complete, and multi-byte UTF-8 characters split across
reads are decoded correctly.
"""

from __future__ import annotations

import codecs
import os
import re
import threading
import time
from collections.abc import Callable
from typing import IO, BinaryIO

__all__ = ["OutputSink", "forward_stream", "rank_dir_name", "make_output_dir"]

_LINE_END = re.compile(r"\r\n|\r|\n")


def rank_dir_name(rank: int, num_proc: int) -> str:
    """``rank.<rank>`` zero-padded to the digits of ``num_proc - 1`` (np=1 gives ``rank.0``)."""
    width = len(str(max(num_proc - 1, 0)))
    return f"rank.{rank:0{width}d}"


def make_output_dir(output_dir: str, sub: str = "") -> str:
    """Create ``--output-filename``'s directory, or ``sub`` in it (a rank's), and return its path.

    Raises:
        ValueError: it cannot be created; the text names the option, the path and why (the bare ``OSError``
            named neither the option nor, for a parent that is a file, which part of the path is wrong).
    """
    path = os.path.join(output_dir, sub) if sub else output_dir
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        what = f"cannot create {path}" if sub else "cannot create the directory"
        raise ValueError(f"--output-filename {output_dir}: {what}: {_why_not_created(path, e)}") from None
    return path


def _why_not_created(path: str, error: OSError) -> str:
    existing = path
    while existing and not os.path.lexists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if existing and os.path.lexists(existing) and not os.path.isdir(existing):
        return f"{existing} is not a directory"
    return error.strerror or str(error)


class OutputSink:
    """A console stream shared by every worker's forwarder; one lock keeps lines whole."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            try:
                buffer = getattr(self._stream, "buffer", None)
                if buffer is not None:
                    self._stream.flush()
                    buffer.write(text.encode("utf-8", "replace"))
                    buffer.flush()
                else:
                    self._stream.write(text)
                    self._stream.flush()
            except (OSError, ValueError):
                pass  # console gone (closed pipe): keep draining the worker so it never blocks


def forward_stream(src: BinaryIO, sink: OutputSink, rank: int, name: str, *,
                   timestamp: bool = False, copy_to: BinaryIO | None = None,
                   on_line: Callable[[str], None] | None = None) -> None:
    """Copy ``src`` to ``sink`` until EOF, each line as ``[<rank>]<name>:<line>``.

    ``copy_to`` (the ``--output-filename`` file) receives the raw bytes, unprefixed; ``on_line`` each line
    as written, unprefixed.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tag = f"[{rank}]<{name}>:"
    pending = ""

    def emit(line: str) -> None:
        prefix = time.asctime() + tag if timestamp else tag
        sink.write(prefix + line)
        if on_line is not None:
            on_line(line)

    fd = src.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if copy_to is not None and chunk:
            copy_to.write(chunk)
            copy_to.flush()
        text = decoder.decode(chunk, final=not chunk)
        if text:
            pending += text
            start = 0
            for match in _LINE_END.finditer(pending):
                # "\r" at the very end might be the first half of "\r\n": wait for the next chunk.
                if match.group() == "\r" and match.end() == len(pending) and chunk:
                    break
                emit(pending[start:match.start()] + ("\r" if match.group() == "\r" else "\n"))
                start = match.end()
            pending = pending[start:]
        if not chunk:
            break
    if pending:
        emit(pending.rstrip("\r") + "\n")  # the last line had no newline: end it so ranks don't merge
