"""The ``horovod`` logger as the knob table says: ``HOROVOD_LOG_LEVEL`` and ``HOROVOD_LOG_HIDE_TIME``.

``hvd.init()`` calls :func:`configure` with the parsed knobs and this process's rank:

* the level of the ``horovod`` logger (every module logs under it) is ``HOROVOD_LOG_LEVEL``
  (``TRACE, DEBUG, INFO, WARNING, ERROR, FATAL``, default ``WARNING``, as upstream's engine);
* while the application has not configured Python logging (the root logger has no handler), the lines go
  to stderr as ``[<time>: <L> <logger>] [rank <r>] <message>``, where ``<L>`` is the level's first letter
  (upstream's style) and ``HOROVOD_LOG_HIDE_TIME=1`` drops ``<time>: ``.  Once the application has a handler
  on the root logger, records go there only, in the application's format (no line is printed twice).

Modules only ever call ``logging.getLogger(__name__)``; nothing else sets levels or handlers in a worker.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["TRACE", "LEVELS", "configure", "python_level"]

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

LEVELS = {"TRACE": TRACE, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
          "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
"""``HOROVOD_LOG_LEVEL`` names (``horovod.base.config.LOG_LEVELS``) → Python levels."""

_LETTERS = {TRACE: "T", logging.DEBUG: "D", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
            logging.CRITICAL: "F"}


def python_level(name: str) -> int:
    """The Python level of a ``HOROVOD_LOG_LEVEL`` name (any case)."""
    return LEVELS[name.upper()]


class _Formatter(logging.Formatter):
    def __init__(self, rank: int, hide_time: bool) -> None:
        super().__init__()
        self.rank = rank
        self.hide_time = hide_time

    def format(self, record: logging.LogRecord) -> str:
        letter = _LETTERS.get(record.levelno, record.levelname[:1])
        when = "" if self.hide_time else f"{self.formatTime(record, '%Y-%m-%d %H:%M:%S')}.{int(record.msecs):03d}: "
        text = f"[{when}{letter} {record.name}] [rank {self.rank}] {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _StderrHandler(logging.Handler):
    """Writes to the current ``sys.stderr`` unless the root logger has a handler (which then gets the record)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


_handler: _StderrHandler | None = None


def configure(level: str, hide_time: bool, rank: int) -> None:
    """Apply the log knobs to the ``horovod`` logger (idempotent; a later call updates rank and format)."""
    global _handler
    logger = logging.getLogger("horovod")
    logger.setLevel(python_level(level))
    if _handler is None:
        _handler = _StderrHandler()
        logger.addHandler(_handler)
    _handler.setFormatter(_Formatter(rank, hide_time))
