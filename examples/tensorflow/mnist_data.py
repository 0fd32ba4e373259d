"""MNIST for the examples: the real data set when it can be downloaded (or is cached in ~/.keras), otherwise
generated, learnable 28x28 "digits" (a class-specific pattern plus noise) so the examples run offline."""

from __future__ import annotations

import logging
import os
import socket

import numpy as np

log = logging.getLogger(__name__)


def load_mnist(offline_samples: int = int(os.environ.get("MNIST_OFFLINE_SAMPLES", 6000)), seed: int = 0):
    """Return ``(x_train, y_train), (x_test, y_test)`` as uint8 images [N, 28, 28] and int64 labels."""
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)
    try:
        import tensorflow as tf

        (x, y), (xt, yt) = tf.keras.datasets.mnist.load_data()
        return (x, y.astype(np.int64)), (xt, yt.astype(np.int64))
    except Exception as e:  # noqa: BLE001 - no network here: fall back to generated data
        log.warning("MNIST download failed (%s); using generated digits", type(e).__name__)
    finally:
        socket.setdefaulttimeout(old)
    rng = np.random.default_rng(seed)  # the same data on every rank
    patterns = rng.uniform(0, 255, size=(10, 28, 28))

    def make(n):
        labels = rng.integers(0, 10, n)
        images = 0.6 * patterns[labels] + rng.uniform(0, 100, size=(n, 28, 28))
        return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int64)

    return make(offline_samples), make(offline_samples // 6)
