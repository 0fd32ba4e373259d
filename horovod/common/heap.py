"""Keep glibc from handing the top of its heap back to the system after every training step.

A training step allocates and frees the same large buffers (activations, gradients, results) each time.
glibc's ``free`` returns the heap's top to the kernel whenever it has grown past a threshold that glibc itself
moves as the program runs, and the next step faults those pages in again, zero-filled: 1000-2200 minor faults
per MobileNetV2 step on one rank (8 MB, ~3 ms of a 44 ms step) in one layout of the step's buffers and almost
none in another, so any change to which buffer lives where (results written into the gradients' own buffers,
result buffers allocated earlier or later) moved the step time by 5-7%, on one rank at a time
(docs/benchmarks.md).  ``HOROVOD_RETAIN_HEAP=1`` makes :func:`~horovod.common.basics.init` keep what the
process has: buffers below 32 MiB come from the heap (glibc moves its threshold there anyway once such a
buffer is freed) and the heap's top is never trimmed -- what MPI libraries have long done for registered
memory (Open MPI's ``mpi_leave_pinned``).  The heap then does not shrink below its peak while the process
lives.  Off by default: it changes the whole process's allocator, and it speeds up whatever faulted, the
single-process steps as much as ours (Keras dense in the same process: the plain step 1.5-2 ms faster, ours
unchanged, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["retain_heap"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)

_done = False


def retain_heap() -> bool:
    """Apply the two settings once per process; False where libc is not glibc (nothing to do there)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has mallopt as a stub)
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The threshold first: setting either one stops glibc from moving both.
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))
    if not _done:
        log.debug("mallopt refused the heap settings; glibc's defaults stay")
    return _done
