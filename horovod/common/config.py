"""Moved to :mod:`horovod.base.config` (the floor below the transport and the engine).

This name stays an alias of that very module -- ``horovod.common.config is horovod.base.config`` -- so code
written before the split (and monkeypatching in its tests) keeps working; new code imports
``horovod.base.config``.
"""

import sys

from horovod.base import config as _config

sys.modules[__name__] = _config
