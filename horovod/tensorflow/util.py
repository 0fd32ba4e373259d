"""Small helpers with upstream's names (``horovod.tensorflow.util``)."""

from __future__ import annotations

import functools

import tensorflow as tf

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars", "split_list"]


def _executing_eagerly() -> bool:
    return tf.executing_eagerly()


def _make_subgraph(f):
    return tf.function(f)


def _cache(f):
    """Memoise ``f`` per (arguments, eager/graph context, default graph)."""
    cache: dict = {}

    @functools.wraps(f)
    def wrapper(*args):
        key = (args, tf.executing_eagerly(), None if tf.executing_eagerly() else tf.compat.v1.get_default_graph())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]
    return wrapper


def vars_to_refs(vars):
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref()


def refs_to_vars(refs):
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


def split_list(items: list, n: int) -> list[list]:
    """Split ``items`` into ``n`` nearly equal consecutive chunks (upstream's ``split_list``)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]
