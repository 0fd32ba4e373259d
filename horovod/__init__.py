"""Horovod, rebuilt in pure Python."""

__version__ = "1.0.0.dev0"


def run(*args, **kwargs):
    """Run a function on ``np`` processes and return the per-rank results (see ``horovod.runner.run``)."""
    from horovod.runner import run as _run

    return _run(*args, **kwargs)
