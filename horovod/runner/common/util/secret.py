"""Upstream's ``secret``: the per-job key and HMAC-SHA256 digests over messages.

``HOROVOD_SECRET_KEY`` names the variable through which the launcher hands workers the key (hex, see
``horovod.base.auth``); upstream called it ``_HOROVOD_SECRET_KEY``.
"""

from __future__ import annotations

import hashlib
import hmac

from horovod.base import auth

__all__ = ["SECRET_LENGTH", "DIGEST_LENGTH", "HOROVOD_SECRET_KEY", "make_secret_key", "compute_digest",
           "check_digest"]

SECRET_LENGTH = 32  # bytes
DIGEST_LENGTH = 32  # bytes
HOROVOD_SECRET_KEY = auth.SECRET_KEY_ENV


def make_secret_key() -> bytes:
    """A fresh random key of :data:`SECRET_LENGTH` bytes."""
    return auth.make_secret_key()


def compute_digest(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under ``key``."""
    return hmac.new(key, message, hashlib.sha256).digest()


def check_digest(key: bytes, message: bytes, digest: bytes) -> bool:
    """Whether ``digest`` is ``message``'s HMAC under ``key`` (constant-time comparison)."""
    return hmac.compare_digest(compute_digest(key, message), digest)
