"""Moved to :mod:`horovod.base.auth` (the floor below the transport and the engine).

This name stays an alias of that very module -- ``horovod.common.auth is horovod.base.auth`` -- so code written
before the split keeps working; new code imports ``horovod.base.auth``.
"""

import sys

from horovod.base import auth as _auth

sys.modules[__name__] = _auth
