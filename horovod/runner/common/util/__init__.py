"""Upstream's ``horovod.runner.common.util``: the launcher helpers that user code and upstream's tests import.

Each module keeps upstream's names and behaviour on top of our launcher (``horovod.runner.hosts``,
``horovod.base.auth``...): ``codec``, ``env``, ``hosts``, ``safe_shell_exec``, ``secret``, ``settings``,
``timeout``.
"""
