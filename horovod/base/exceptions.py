"""The exception tree.

``HorovodError`` is the root of our own errors.  ``HorovodInternalError`` (a ``RuntimeError`` as upstream)
marks failures that elastic mode recovers from: a collective failed because a peer died or the job was shut
down.  Mismatches detected by the coordinator are ``PreconditionError`` (also a ``HorovodInternalError`` so
torch users catch them as upstream's ``RuntimeError``), and so is a shutdown for mismatched collectives (ranks
that submitted different collectives and waited for each other until the stall deadline); elastic mode does
not recover from a ``PreconditionError``, a program error that a reset cannot cure.  Bad arguments detected
at enqueue are ``ValueError``s.
"""

from __future__ import annotations

__all__ = [
    "HorovodError", "HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError",
    "PreconditionError", "ShutdownError", "AbortedError", "WireError", "SHUT_DOWN_MESSAGE", "MISMATCHED_COLLECTIVES",
    "shutdown_error",
]

SHUT_DOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
    "allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the shutdown "
    "was caused by an exception, you should see the exception in the log before the first shutdown message."
)


MISMATCHED_COLLECTIVES = "Mismatched collectives:"
"""The start of a shutdown reason that is a program error, not a fault: the ranks submitted different
collectives and each waited for the others until the stall deadline (``coordinator.mismatched_collectives``).
Operations failed by such a shutdown raise :class:`PreconditionError`, as the other mismatches, instead of
:class:`ShutdownError`: elastic mode does not reset for it (a reset runs into the same mismatch, forever)."""


class HorovodError(Exception):
    """Base class of the errors this package raises on its own account."""


class HorovodInternalError(RuntimeError, HorovodError):
    """A collective could not complete (peer failure, shutdown, mismatch); elastic mode recovers from it."""


class PreconditionError(HorovodInternalError):
    """The ranks disagreed about a collective (dtype, shape, op, root, ...); upstream's PRECONDITION status."""


class ShutdownError(HorovodInternalError):
    """The engine shut down while the operation was pending; upstream's UNKNOWN status."""


class AbortedError(HorovodInternalError):
    """The operation is not supported in this combination; upstream's ABORTED status."""


def shutdown_error(message: str, reason: str | None) -> HorovodInternalError:
    """The error of an operation that the job's shutdown failed (``reason``: its cause; ``message``: the
    shut-down text with the cause): :class:`PreconditionError` whose text starts with the cause for mismatched
    collectives (:data:`MISMATCHED_COLLECTIVES`), else :class:`ShutdownError`."""
    if reason is not None and reason.startswith(MISMATCHED_COLLECTIVES):
        return PreconditionError(f"{reason} Horovod has been shut down.")
    return ShutdownError(message)


class WireError(HorovodError, ConnectionError):
    """A peer sent bytes that are not a valid frame of our protocol, or failed authentication."""


class HostsUpdatedInterrupt(RuntimeError, HorovodError):
    """Raised in elastic mode when the set of hosts changed; ``skip_sync`` says whether state sync is needed."""

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError, HorovodError):
    """A framework extension was built for another version (kept for API compatibility)."""

    def __init__(self, name: str = "", version: str = "", installed_version: str = "") -> None:
        super().__init__(f"Framework {name} installed with version {installed_version} but found version "
                         f"{version}.")
        self.name = name
        self.version = version
        self.installed_version = installed_version


def follows_from_another_rank(error_text: str) -> bool:
    """Whether a rank's error (``"<Type>: <message>"``) only follows from another rank's failure -- the
    shut-down notice, a lost or mismatched peer -- so that launchers name the rank that failed first."""
    text = error_text.strip()
    return text.startswith(("ShutdownError", "GenerationMismatch", "PeerFailure")) or "called shutdown()" in text
