"""Upstream's ``horovod.runner.common`` package (``util``)."""
