"""Small helpers with upstream's names (``horovod.tensorflow.util``)."""

from __future__ import annotations

import functools

import tensorflow as tf

from horovod.common.util import split_list

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars", "split_list"]


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not inside a graph or tf.function trace)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    """``f`` as a ``tf.function`` (upstream's name for it)."""
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
    """Variables (nested lists) as hashable references: tuples of ``v.ref()``."""
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref()


def refs_to_vars(refs):
    """The inverse of :func:`vars_to_refs`."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
