"""``python -m horovod.runner``: the same as ``horovodrun``."""

from horovod.runner.launch import run_commandline

if __name__ == "__main__":
    run_commandline()
