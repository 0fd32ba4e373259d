"""Upstream's module path for the exception tree, defined in :mod:`horovod.base.exceptions` (the floor the
transport and the engine raise from); the classes are the same objects."""

from horovod.base.exceptions import *  # noqa: F403 - the public names, re-exported
from horovod.base.exceptions import __all__  # noqa: F401
