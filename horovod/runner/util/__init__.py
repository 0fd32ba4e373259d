"""Upstream's ``horovod.runner.util`` package (``threads``)."""
