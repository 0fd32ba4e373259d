"""Proof of the job's secret key.

The launcher creates a random per-job key and passes it to workers in ``HOROVOD_SECRET_KEY`` (hex).  Every
connection between workers, and every request to the rendezvous store, proves knowledge of it with an HMAC
over a fresh nonce, so a process without the key is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from horovod.base.config import read_env

__all__ = ["SECRET_KEY_ENV", "make_secret_key", "secret_key_from_env", "digest", "verify", "nonce"]

SECRET_KEY_ENV = "HOROVOD_SECRET_KEY"
DIGEST_SIZE = 32
NONCE_SIZE = 32


def make_secret_key() -> bytes:
    return secrets.token_bytes(32)


def secret_key_from_env() -> bytes | None:
    """The job key from the environment, or None when running without a launcher.

    Raises:
        ValueError: the variable is set but not hex (the text names it, never the value).
    """
    return read_env(SECRET_KEY_ENV)


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def digest(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def verify(key: bytes, expected_digest: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(digest(key, *parts), expected_digest)
