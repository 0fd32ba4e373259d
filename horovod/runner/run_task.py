"""Worker side of ``horovod.run``: ``python -m horovod.runner.run_task [<store addr> <store port>]``.

Fetches the pickled ``(func, args, kwargs)`` from the launcher's rendezvous store -- the only way it
travels, so it is read only by processes holding the job key -- runs it and stores the pickled result
under ``runfunc_result/<rank>``.  The store's answer is unpickled only after it proved the job key too
(``StoreClient`` verifies the answer's signature before reading its body), so whatever else listens on that
port cannot make this worker run code of its choice.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from horovod.base.config import env_int, read_env, start_timeout
from horovod.runner.run_func import FUNC_KEY, RESULT_SCOPE

__all__ = ["main"]


_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _rank() -> int:
    """The rank this process ended with: Horovod's if it is initialized (elastic jobs change it), else the
    launcher's (or mpirun's)."""
    from horovod.common import basics

    if basics.is_initialized():
        return basics.rank()
    for name in _RANK_VARS:
        if os.environ.get(name):
            return env_int(name, 0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stored function once; returns the process exit status."""
    import cloudpickle

    from horovod.base import auth
    from horovod.transport.store import StoreClient, StoreError

    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) not in (0, 2):
        sys.stderr.write("usage: python -m horovod.runner.run_task [<store addr> <store port>]\n")
        return 2
    # Elastic workers get the store's address from their environment (it depends on their host).
    addr, port = argv if argv else (read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR"), read_env("HOROVOD_GLOO_RENDEZVOUS_PORT"))
    key = auth.secret_key_from_env()
    if key is None:
        sys.stderr.write(f"horovod.runner.run_task: {auth.SECRET_KEY_ENV} is not set; start it with "
                         "horovod.run()\n")
        return 2
    timeout = start_timeout()
    client = StoreClient(addr, int(port), key, timeout=timeout)
    try:
        payload = client.get(FUNC_KEY)  # verified: signed with the job key, for this very request
    except StoreError as e:
        sys.stderr.write(f"horovod.runner.run_task: cannot fetch the function to run: {e}\n")
        return 1
    func, args, kwargs = cloudpickle.loads(payload)
    try:
        result = func(*args, **kwargs)
    except BaseException as e:
        sys.stderr.write(f"User function raise error: {e}\n")
        traceback.print_exc()
        return 1
    client.put(_result_key(), cloudpickle.dumps(result))
    return 0


def _result_key() -> str:
    """Where this worker stores its result: under its rank, or, for an elastic worker whose function never
    called ``hvd.init()`` (elastic workers get no rank in their environment: it changes with each reset),
    under its slot, which the driver maps to the slot's rank (upstream's elastic workers return a result
    each; all of them were stored as rank 0's)."""
    from horovod.common import basics

    slot = read_env("HOROVOD_ELASTIC_SLOT") if read_env("HOROVOD_ELASTIC") else ""
    if slot and not basics.is_initialized() and not any(os.environ.get(name) for name in _RANK_VARS):
        return f"{RESULT_SCOPE}/slot.{slot}"
    return f"{RESULT_SCOPE}/{_rank()}"


if __name__ == "__main__":
    sys.exit(main())
