"""A Horovod process of ``horovod.spark.run``: ``python -m horovod.spark._worker`` (started by its Spark task).

Fetches the pickled ``(fn, args, kwargs)`` from the driver's rendezvous store -- the answer is unpickled
only after it proved the job key -- runs it, and writes the pickled ``(final rank, result)`` (or the error)
to the files its task named in ``HOROVOD_SPARK_RESULT_FILE``/``HOROVOD_SPARK_ERROR_FILE``; the task hands the result to
Spark's ``collect`` and the error to the driver.
"""

from __future__ import annotations

import os
import sys
import traceback

from horovod.spark.task import ERROR_ENV, FUNC_KEY, RESULT_ENV

__all__ = ["main"]


def _write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def main() -> int:
    """Run the job's function once; returns the process exit status."""
    import cloudpickle

    from horovod.base import auth
    from horovod.base.config import read_env, start_timeout
    from horovod.transport.store import StoreClient, StoreError

    result_file, error_file = os.environ.get(RESULT_ENV), os.environ.get(ERROR_ENV)
    key = auth.secret_key_from_env()
    if not result_file or not error_file or key is None:
        sys.stderr.write("horovod.spark._worker: start it through horovod.spark.run()\n")
        return 2
    client = StoreClient(read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR"), int(read_env("HOROVOD_GLOO_RENDEZVOUS_PORT")),
                         key, timeout=start_timeout())
    try:
        fn, args, kwargs = cloudpickle.loads(client.get(FUNC_KEY))
        result = fn(*args, **kwargs)
        # The rank this process ended with (elastic jobs change it): the driver orders the results by it.
        payload = cloudpickle.dumps((int(os.environ.get("HOROVOD_RANK") or -1), result))
    except BaseException as e:  # noqa: BLE001 - any failure of the user's function is reported, then exit 1
        text = traceback.format_exc()
        if isinstance(e, StoreError):
            text = f"cannot fetch the function to run: {e}\n"
        sys.stderr.write(text)
        _write(error_file, f"{type(e).__name__}: {e}\n{text}".encode("utf-8", "replace"))
        if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code:  # sys.exit(N): N, as a process
            return e.code
        return 1
    _write(result_file, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
