"""The exception tree.

``HorovodError`` is the root of our own errors.  ``HorovodInternalError`` (a ``RuntimeError`` as upstream)
marks failures that elastic mode recovers from: a collective failed because a peer died or the job was shut
down.  Mismatches detected by the coordinator are ``PreconditionError`` (also a ``HorovodInternalError`` so
torch users catch them as upstream's ``RuntimeError``); bad arguments detected at enqueue are
``ValueError``s.
"""

from __future__ import annotations

__all__ = [
    "HorovodError", "HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError",
    "PreconditionError", "ShutdownError", "AbortedError", "WireError", "SHUT_DOWN_MESSAGE",
]

SHUT_DOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
    "allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the shutdown "
    "was caused by an exception, you should see the exception in the log before the first shutdown message."
)


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
