"""Upstream's ``codec``: objects as base64 text of a cloudpickle.

Only for data you produced yourself: unpickling runs code.  Our launcher and workers never decode data
they did not sign (docs/security.md); this module exists for user code written against upstream.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

import cloudpickle

__all__ = ["dumps_base64", "loads_base64"]


def dumps_base64(obj: Any, to_ascii: bool = True) -> str | bytes:
    """``obj`` as base64 of its cloudpickle; ``str`` when ``to_ascii``, else ``bytes``."""
    encoded = base64.b64encode(cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return encoded.decode("ascii") if to_ascii else encoded


def loads_base64(encoded: str | bytes) -> Any:
    """The object :func:`dumps_base64` encoded."""
    return cloudpickle.loads(base64.b64decode(encoded))
