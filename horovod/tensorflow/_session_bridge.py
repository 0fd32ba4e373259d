"""Deliver collective results into TF1 ``Session`` graphs without holding an inter-op thread.

Inside ``tf.function`` a collective's result travels through an eager ``FIFOQueue`` whose ``dequeue`` is an
asynchronous kernel (see :mod:`horovod.tensorflow._bridge`).  A TF1 graph gets the same shape: every
collective site owns a ``FIFOQueue`` in the graph and receives with its ``dequeue``, so a waiting collective
holds no thread of the session's inter-op pool and every submit op runs, whatever the pool size and the
order in which the ranks schedule independent collectives (upstream gets this from C++ async kernels).

A graph queue lives in the resource manager of the *session* that runs the graph, so the completer fills it
with a ``Session.run`` of the site's enqueue op on that session.  To know which session ran a submit op,
``Session.run`` and ``Session.make_callable`` are wrapped (once, when the first TF1 collective is built): a
run of a graph that holds collectives feeds a fresh token to a placeholder that every submit op reads, and
the token names the session.  When a run ends early (an error in one collective, a cancelled run), results
it never dequeued are drained so that the next run cannot read them.

A collective's error reaches TensorFlow from a ``numpy_function``, which turns it into ``UnknownError``; the
receiving op records the error it raised (:func:`failed`) and the wrapped run re-raises TensorFlow's error
with that class (upstream's ``FailedPreconditionError`` for a mismatch) and upstream's message.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.client import session as _tf_session

from horovod.common.exceptions import HorovodInternalError

__all__ = ["Site", "new_site", "run_token", "deliver", "consumed", "failed", "session_of"]

log = logging.getLogger(__name__)

_GRAPH_ATTR = "_horovod_session_bridge"
_NO_TOKEN = -1


class Site:
    """One collective op of a TF1 graph: its queue, the ops that fill and drain it, the feeds of the fill."""

    def __init__(self, site_id: int, out_dtypes: Sequence[tf.DType]) -> None:
        self.id = site_id
        dtypes = [*out_dtypes, tf.int64, tf.int64]  # outputs, error id, run token
        self.queue = tf.queue.FIFOQueue(1 << 16, dtypes, name=f"HorovodResults_{site_id}")
        self.feeds = [tf.compat.v1.placeholder(d, None, name=f"HorovodResult_{site_id}_{i}")
                      for i, d in enumerate(dtypes)]
        self.enqueue = self.queue.enqueue(self.feeds, name=f"HorovodDeliver_{site_id}")
        self.drain = self.queue.dequeue(name=f"HorovodDrain_{site_id}")


class _GraphState:
    """Per graph: the run-token placeholder and the number of sites built so far."""

    def __init__(self) -> None:
        self.token = tf.compat.v1.placeholder_with_default(np.int64(_NO_TOKEN), [], name="HorovodRunToken")
        self.sites = itertools.count()


class _Run:
    """One ``Session.run`` of a graph with collectives: which results were delivered and which consumed."""

    def __init__(self, session) -> None:
        self.session = session
        self.alive = True
        self.cond = threading.Condition(threading.Lock())
        self.delivering = 0  # enqueues in progress (a Session.run each: never under the lock)
        self.delivered: collections.Counter[int] = collections.Counter()
        self.consumed: collections.Counter[int] = collections.Counter()
        self.sites: dict[int, Site] = {}
        self.errors: list[tf.errors.OpError] = []  # raised by this run's receive ops, in order


_runs: dict[int, _Run] = {}
_runs_lock = threading.Lock()
_tokens = itertools.count(1)
_original_run = _tf_session.BaseSession.run
_original_make_callable = _tf_session.BaseSession.make_callable
_patched = False


def _graph_state(graph: tf.Graph) -> _GraphState | None:
    return getattr(graph, _GRAPH_ATTR, None)


def new_site(out_dtypes: Sequence[tf.DType]) -> tuple[Site, tf.Tensor]:
    """A site in the outermost graph being built, and the run-token tensor its submit op reads."""
    _install()
    with tf.init_scope():  # the outermost graph (out of cond/while bodies), no control dependencies
        graph = tf.compat.v1.get_default_graph()
        state = _graph_state(graph)
        if state is None:
            with graph.name_scope("HorovodSessionBridge/"):
                state = _GraphState()
            setattr(graph, _GRAPH_ATTR, state)
        with graph.name_scope("HorovodSessionBridge/"):
            site = Site(next(state.sites), out_dtypes)
    return site, state.token


def run_token(token: int) -> _Run:
    """The run a submit op belongs to (raises if the graph was run without the token)."""
    with _runs_lock:
        run = _runs.get(int(token))
    if run is None:
        raise HorovodInternalError(
            "a Horovod collective in a TF1 graph ran outside Session.run/make_callable (for example through "
            "Session.partial_run); run the graph with Session.run")
    return run


def session_of(token: int):
    """The session that runs ``token``'s graph (for tests and diagnostics)."""
    return run_token(token).session


def deliver(run: _Run, site: Site, outs: Sequence[np.ndarray], err_id: int, token: int) -> None:
    """Put one result into ``site``'s queue of the session that submitted it (dropped if that run ended)."""
    feed = {ph: v for ph, v in zip(site.feeds, [*outs, np.int64(err_id), np.int64(token)])}
    with run.cond:
        if not run.alive:
            return
        run.sites[site.id] = site
        run.delivering += 1
    ok = False
    try:
        _original_run(run.session, site.enqueue, feed)
        ok = True
    except Exception:  # noqa: BLE001 - the session is closing; the run that waited has ended with it
        log.debug("dropping a collective result: its session is gone", exc_info=True)
    finally:
        with run.cond:
            run.delivering -= 1
            run.delivered[site.id] += ok
            run.cond.notify_all()


def consumed(token: int, site_id: int) -> None:
    """Called by a site's receive op: the result it dequeued is no longer pending."""
    with _runs_lock:
        run = _runs.get(int(token))
    if run is not None:
        with run.cond:
            run.consumed[site_id] += 1


def failed(token: int, error: tf.errors.OpError) -> None:
    """Called by a site's receive op before it raises ``error`` (with the class upstream uses)."""
    with _runs_lock:
        run = _runs.get(int(token))
    if run is not None:
        with run.cond:
            run.errors.append(error)


def _restore_class(token: int, e: tf.errors.UnknownError) -> tf.errors.OpError | None:
    """The error a receive op of this run raised, as TensorFlow reported it but with its own class."""
    with _runs_lock:
        run = _runs.get(token)
    if run is None:
        return None
    with run.cond:
        errors = list(run.errors)
    for error in errors:
        if type(error) is not tf.errors.UnknownError and error.message in e.message:
            return type(error)(e.node_def, e.op, error.message)
    return None


@contextlib.contextmanager
def _run_scope(session) -> Iterator[int]:
    """Register a run under a fresh token; at its end, drain the results it never dequeued."""
    token = next(_tokens)
    run = _Run(session)
    with _runs_lock:
        _runs[token] = run
    try:
        yield token
    finally:
        with run.cond:
            run.alive = False
            run.cond.wait_for(lambda: run.delivering == 0)
            leftovers = [(run.sites[s], n - run.consumed[s]) for s, n in run.delivered.items()
                         if n > run.consumed[s]]
        with _runs_lock:
            del _runs[token]
        for site, count in leftovers:
            for _ in range(count):
                try:
                    _original_run(session, site.drain)
                except Exception:  # noqa: BLE001 - a closed session drops its queues anyway
                    break


def _run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    state = _graph_state(self.graph)
    if state is None:
        return _original_run(self, fetches, feed_dict, options, run_metadata)
    with _run_scope(self) as token:
        feeds = dict(feed_dict) if feed_dict else {}
        feeds[state.token] = token
        try:
            return _original_run(self, fetches, feeds, options, run_metadata)
        except tf.errors.UnknownError as e:
            restored = _restore_class(token, e)
            if restored is None:
                raise
            raise restored from e


def _make_callable(self, fetches, feed_list=None, accept_options=False):
    state = _graph_state(self.graph)
    if state is None:
        return _original_make_callable(self, fetches, feed_list, accept_options)
    inner = _original_make_callable(self, fetches, [*(feed_list or []), state.token], accept_options)

    @functools.wraps(inner)
    def call(*args, **kwargs):
        with _run_scope(self) as token:
            try:
                return inner(*args, token, **kwargs)
            except tf.errors.UnknownError as e:
                restored = _restore_class(token, e)
                if restored is None:
                    raise
                raise restored from e
    return call


def _install() -> None:
    """Wrap ``Session.run``/``make_callable`` so runs of graphs with collectives carry their token."""
    global _patched
    if _patched:
        return
    _tf_session.BaseSession.run = functools.wraps(_original_run)(_run)
    _tf_session.BaseSession.make_callable = functools.wraps(_original_make_callable)(_make_callable)
    _patched = True

