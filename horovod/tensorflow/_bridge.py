"""Run an engine collective as TensorFlow ops, in eager mode, inside ``tf.function`` and in TF1 graphs.

Eager: the tensors' numpy views are enqueued and waited for right away.

Graph mode splits every collective in two ops so that no TensorFlow thread is ever blocked on a collective
that another rank cannot finish yet:

* **submit** (a stateful ``tf.numpy_function``) enqueues the numpy views of the inputs and returns at once;
* **receive** is a ``FIFOQueue.dequeue`` -- an asynchronous kernel that holds no inter-op thread while it
  waits -- fed by a completer thread that waits for the engine handles in submit order.  Two ranks that run
  independent collectives in different orders therefore always make progress, whatever the size of the
  inter-op pool: every submit runs, and the engine matches requests by name.  Inside ``tf.function`` (the TF2
  case: Keras ``fit``, custom loops) the queue is an eager resource the completer fills directly; in TF1
  graphs (``tf.compat.v1.Session``) it lives in the session, and :mod:`horovod.tensorflow._session_bridge`
  fills it through that session.

Errors: eager raises upstream's ``tf.errors`` types.  In graphs the receive is followed by a ``check`` op (a
``numpy_function``) that raises the collective's error, and TensorFlow turns every Python exception of a
``numpy_function`` into ``UnknownError`` except ``ValueError`` (``InvalidArgumentError``).  In TF1 sessions
the wrapped ``Session.run`` gives the error its upstream class back (``FailedPreconditionError`` for a
mismatch, see :mod:`horovod.tensorflow._session_bridge`); inside ``tf.function`` the class stays
``UnknownError`` and the message carries upstream's class name and text (docs/tensorflow.md).  Every output
depends on its ``check`` through data that no optimisation can fold away (a slice of all of it, starting at
the check's zero: :func:`_after`): Grappler prunes a stateless op whose only consumers are control edges, and
folds chains of reshapes, either of which dropped the error and handed out empty results.
"""

from __future__ import annotations

import itertools
import logging
import queue as _queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from horovod.base.dtypes import dtype_code
from horovod.common import basics as _basics
from horovod.common.basics import NOT_INITIALIZED
from horovod.common.exceptions import AbortedError, HorovodInternalError, PreconditionError, ShutdownError
from horovod.tensorflow import _session_bridge

__all__ = ["Wait", "refuse_before_init_when_traced", "refuse_dtypes", "run_collective", "to_tf_error",
           "writable_inputs_ok"]

log = logging.getLogger(__name__)

Finish = Callable[[], list]
Submit = Callable[[list], Finish]
Deliver = Callable[[list, int], None]


def to_tf_error(e: BaseException) -> BaseException:
    """Map an engine exception to the ``tf.errors`` class upstream raises."""
    if isinstance(e, tf.errors.OpError):
        return e
    msg = str(e)
    if isinstance(e, PreconditionError):
        return tf.errors.FailedPreconditionError(None, None, msg)
    if isinstance(e, AbortedError):
        return tf.errors.AbortedError(None, None, msg)
    if isinstance(e, ShutdownError):
        return tf.errors.UnknownError(None, None, msg)
    if isinstance(e, HorovodInternalError):
        return tf.errors.UnknownError(None, None, msg)
    if isinstance(e, ValueError):
        if msg == NOT_INITIALIZED:  # upstream's kernels check initialisation first: a PRECONDITION status
            return tf.errors.FailedPreconditionError(None, None, msg)
        return tf.errors.InvalidArgumentError(None, None, msg)
    return e


_plain = tf.autograph.experimental.do_not_convert
"""Calls made at run time (numpy_function callbacks, the completer) run unconverted by AutoGraph even when the
closures were created by code AutoGraph converted: converted code would convert the engine on every call."""


XLA_MESSAGE = ("{name}: Horovod's TensorFlow collectives run in Python and cannot be compiled by XLA; this one is "
               "inside an XLA-compiled function (tf.function(jit_compile=True), or a Keras model compiled with "
               "jit_compile=True): use jit_compile=False there (Keras' default 'auto' already does so for a model "
               "whose optimizer is a hvd.DistributedOptimizer)")


def refuse_xla(name: str) -> None:
    """Raise at trace time when the graph being built is XLA-compiled: a ``numpy_function`` there fails only
    when the step runs, with an XLA error that names neither Horovod nor jit_compile."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # a TensorFlow without this helper: XLA reports it itself
        return
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(XLA_MESSAGE.format(name=name))


def _wrap(fn: Callable):
    fn = _plain(fn)

    def inner(*args):
        try:
            return fn(*args)
        except tf.errors.OpError:
            raise
        except ValueError:
            raise  # numpy_function turns it into InvalidArgumentError
        except Exception as e:  # noqa: BLE001 - re-raised with the TF type where TF keeps it
            raise to_tf_error(e) from e
    return inner


def _as_numpy(t: tf.Tensor) -> np.ndarray:
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


class _Completer:
    """Waits for engine handles in submit order and hands each result (or error id) to its receive queue."""

    def __init__(self) -> None:
        self._work: _queue.SimpleQueue = _queue.SimpleQueue()
        self._errors: dict[int, BaseException] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, finish: Finish, deliver: Deliver, dtypes: list[np.dtype]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="horovod-tf-completer", daemon=True)
                self._thread.start()
        self._work.put((_plain(finish), _plain(deliver), dtypes))

    def take_error(self, err_id: int) -> BaseException:
        with self._lock:
            return self._errors.pop(err_id)

    def _run(self) -> None:
        while True:
            finish, deliver, dtypes = self._work.get()
            try:  # TF tensors (as_tf_tensor) travel as they are: no copy into a new tensor
                outs = [o if isinstance(o, tf.Tensor) else np.asarray(o, dtype=d) for o, d in zip(finish(), dtypes)]
                err = -1
            except BaseException as e:  # noqa: BLE001 - delivered to the receiving op
                with self._lock:
                    err = next(self._ids)
                    self._errors[err] = e
                outs = [np.zeros(0, d) for d in dtypes]
            try:
                deliver(outs, err)
            except Exception:  # noqa: BLE001 - the queue's owner is gone (function deleted)
                log.debug("dropping a collective result: its receive queue is gone", exc_info=True)
            del outs, finish, deliver  # a result (up to a model's gradients) is not held until the next one


_completer = _Completer()


class Wait:
    """The finish of a submit that only waits for engine handles (and converts their results), so that
    the submit op may first try it within a bound (:meth:`within`) and skip the completer (see
    :func:`_receive_in_function`).  Once finished it drops the handles, and with them the engine's views of
    the tensors (results written into TensorFlow-owned buffers may then be updated in place)."""

    __slots__ = ("_handles", "_convert")

    def __init__(self, handles: list, convert: Callable[[list], list] | None = None) -> None:
        self._handles = handles
        self._convert = convert

    def __call__(self) -> list:
        return self.within(None)

    def within(self, timeout: float | None) -> list:
        """The results; ``TimeoutError`` (handles kept, to be waited for again) if they take longer."""
        handles = self._handles
        if timeout is not None:
            deadline = time.monotonic() + timeout
            for h in handles:
                h.wait(max(0.0, deadline - time.monotonic()))
        results = [h.wait() for h in handles]
        out = self._convert(results) if self._convert is not None else results
        self._handles = []  # (kept when the conversion raised: the completer's second call raises it again)
        return out

    def with_check(self, handle, check: Callable[[np.ndarray], None]) -> Wait:
        """This wait, also waiting for ``handle`` (after the others) and handing its result to ``check``,
        which may raise, before the conversion."""
        convert = self._convert

        def checked(results: list) -> list:
            check(results[-1])
            return convert(results[:-1]) if convert is not None else results[:-1]
        return Wait([*self._handles, handle], checked)
_DIRECT_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16, tf.int32, tf.int64)
_owned_ok: bool | None = None


def writable_inputs_ok() -> bool:
    """Whether a ``numpy_function`` sees its inputs as writable views of TensorFlow's buffers (checked once).

    :func:`run_collective`'s ``owned`` outputs rely on it: the engine writes results into the numpy views of
    tensors TensorFlow allocated (``Empty``), which the graph then uses as the results.  Where TensorFlow
    copied the inputs instead, allreduces take the general path (results copied into new tensors)."""
    global _owned_ok
    if _owned_ok is None:
        def fill(buf):
            buf[...] = 3.0
            return np.int64(0)

        @tf.function(autograph=False)
        def probe():
            buf = tf.raw_ops.Empty(shape=[16], dtype=tf.float32)
            token = tf.numpy_function(fill, [buf], tf.int64, stateful=True)
            return tf.reduce_sum(_after(token, [buf])[0])
        try:
            with tf.init_scope():  # asked while a function is traced: run the probe eagerly
                _owned_ok = float(probe()) == 48.0
        except Exception:  # noqa: BLE001 - fall back to copying results
            _owned_ok = False
        if not _owned_ok:
            log.info("horovod.tensorflow: results are copied into TensorFlow tensors (numpy_function copies)")
    return _owned_ok


def _queue_path() -> bool:
    """True inside ``tf.function`` (eager outside): results can travel through an eager queue."""
    return tf.compat.v1.executing_eagerly_outside_functions()


_CARRIED = (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64, tf.bool,
            tf.bfloat16)
_carried_ok: dict = {}


def refuse_dtypes(tensors: Sequence[tf.Tensor]) -> None:
    """A tensor whose dtype the engine does not carry (string, complex, uint32, ...) is a ``TypeError`` when the
    op is built, eagerly or traced, as upstream's ops' type constraints raise it; the engine's ``ValueError``
    came as ``InvalidArgumentError`` (inside ``tf.function`` only when the function ran)."""
    for t in tensors:
        dtype = t.dtype if isinstance(t.dtype, tf.DType) else tf.as_dtype(t.dtype)  # (a Keras variable's: a str)
        ok = _carried_ok.get(dtype)
        if ok is None:
            try:
                dtype_code(np.dtype(dtype.as_numpy_dtype))
                ok = True
            except (TypeError, ValueError):
                ok = False
            _carried_ok[dtype] = ok
        if not ok:
            raise TypeError(f"Value passed to parameter 'tensor' has DataType {dtype.name} not in list of allowed "
                            f"values: {', '.join(d.name for d in _CARRIED)}")


def refuse_before_init_when_traced() -> None:
    """Inside ``tf.function``, a collective traced before ``hvd.init()`` raises upstream's
    ``FailedPreconditionError`` ('Horovod has not been initialized; use hvd.init().') right away.  Upstream's
    kernels check initialisation first and fail with that class when the function runs; ours would fail in the
    submit op, where TensorFlow turns the error of a ``numpy_function`` into ``InvalidArgumentError``, and no
    op we can build keeps the class.  TF1 graphs may still be built before ``hvd.init()`` (the wrapped
    ``Session.run`` gives a run before it upstream's class)."""
    if _queue_path() and not _basics.is_initialized():
        raise tf.errors.FailedPreconditionError(None, None, NOT_INITIALIZED)


@_plain
def run_collective(submit: Submit, inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
                   name: str = "Horovod", owned: Sequence[tf.Tensor] = ()) -> list[tf.Tensor]:
    """Run ``submit`` (numpy inputs → finish() → numpy outputs) as TF ops; returns the output tensors.

    ``owned`` (inside ``tf.function`` only, see :func:`writable_inputs_ok`): tensors TensorFlow allocated for
    results that ``submit`` writes itself; they follow the inputs in its arguments as writable views, and
    come back after the outputs once the collective is done.  ``finish`` must drop its views before it
    returns, so that TensorFlow's next op may update the tensors in place."""
    refuse_dtypes(inputs)
    np_dtypes = [d.as_numpy_dtype for d in out_dtypes]
    submit = _plain(submit)
    if owned and (tf.executing_eagerly() or not _queue_path()):
        raise ValueError("run_collective: owned outputs exist only inside tf.function")
    if tf.executing_eagerly():
        try:
            outs = submit([_as_numpy(t) for t in inputs])()
        except Exception as e:  # noqa: BLE001
            raise to_tf_error(e) from e
        return [tf.convert_to_tensor(np.asarray(o, dtype=d)) for o, d in zip(outs, np_dtypes)]

    refuse_xla(name)
    refuse_before_init_when_traced()
    if _queue_path():
        return _receive_in_function(submit, inputs, out_dtypes, np_dtypes, name, owned)
    return _receive_in_session(submit, inputs, out_dtypes, np_dtypes, name)


class _Site:
    """One collective of a traced function: its receive queue, and which call of it may deliver.

    A call whose step was aborted (another op of the function failed) had its dequeue cancelled, but its
    collective still completes and delivers: without this, that result stayed in the queue and every later
    call read the result of the call before it (or, for results written into TensorFlow-owned buffers, the
    buffers before the engine wrote them).  So a call first drops what is left in the queue, and a delivery
    is dropped once a later call has started; the lock keeps the two apart.  Asking the queue costs an eager
    op (~0.2 ms inside a running function), so it is asked only when a delivery was not read by its check
    (an aborted call, or a function whose results nothing uses, where the check is pruned)."""

    def __init__(self, queue) -> None:
        self.queue = queue
        self.calls = 0
        self.unread = 0  # deliveries no check has read yet
        self.lock = threading.Lock()

    def start(self, submit: Submit, arrays: list) -> tuple[int, Finish]:
        with self.lock:
            self.calls += 1
            if self.unread:
                self._drop_stale()
            try:
                return self.calls, submit(arrays)
            except BaseException:
                self.calls -= 1  # (a concurrent call of the same collective: the first one still delivers)
                raise

    def _drop_stale(self) -> None:
        stale = int(self.queue.size())
        if stale:
            log.debug("dropping %d result(s) of aborted calls", stale)
        for _ in range(stale):  # (dequeue_many needs shapes the queue does not declare)
            err = self.queue.dequeue()
            err = int((err[-1] if isinstance(err, (list, tuple)) else err).numpy())
            if err >= 0:
                _completer.take_error(err)
        self.unread = 0

    def deliver(self, call: int, outs: list, err: int) -> None:
        with self.lock:
            if call == self.calls:
                _enqueue(self.queue, outs, err)
                self.unread += 1
            elif err >= 0:
                _completer.take_error(err)

    def check(self, err):
        """The check op: the delivery was read; raise its error, if any."""
        with self.lock:
            self.unread = max(0, self.unread - 1)
        if err >= 0:
            raise _completer.take_error(int(err))
        return np.int64(0)


QUICK_BYTES = 64 * 1024
"""Graph collectives whose tensors (inputs and results written in place) take at most this many bytes may be
finished by their submit op (see :func:`_receive_in_function`): a latency-bound one (a metric, a
SyncBatchNormalization's statistics), not the gradients, whose bytes take longer than the wake-ups it saves."""
QUICK_WAIT_S = 1e-3
"""How long the submit op waits for a quick collective before the completer takes it over."""
_quick_waiter = threading.Lock()  # one inter-op thread at most waits in a submit op (the others run the graph)


def _quick(tensors: Sequence[tf.Tensor]) -> bool:
    if not all(t.shape.is_fully_defined() for t in tensors):
        return False
    return sum(t.shape.num_elements() * t.dtype.size for t in tensors) <= QUICK_BYTES


def _receive_in_function(submit: Submit, inputs, out_dtypes, np_dtypes, name: str,
                         owned: Sequence[tf.Tensor] = ()) -> list[tf.Tensor]:
    """Inside ``tf.function``: an eager queue the completer fills directly.

    A small collective is first waited for by its submit op itself, for up to :data:`QUICK_WAIT_S`, running
    the engine's rounds in TensorFlow's thread: when the peers are there, the answer wakes that thread and the
    results leave with the submit op's own outputs, without the completer's wake-up, the queue's eager
    enqueue and the check (~0.2-0.3 ms of a ~0.9 ms collective on a 2-core host).  Otherwise the completer
    takes it over, as it does every larger one, and errors too go that way: a submit op that raised would end
    the step before the function's later submits, which the peers may have made (and would wait for
    forever).  The wait sleeps (a spinning waiter took the time slices the peer needed under load), holds one
    inter-op thread at most, and is bounded, so two ranks that run independent collectives in different
    orders still make progress."""
    with tf.init_scope():
        site = _Site(tf.queue.FIFOQueue(1 << 16, [*out_dtypes, tf.int64]))
    tf_queue = site.queue
    quick = _quick([*inputs, *owned])
    nothing = [np.zeros(0, d) for d in np_dtypes] if quick else []  # the submit op's results when not finished

    def do_submit(*arrays):
        call, finish = site.start(submit, list(arrays))
        if quick and isinstance(finish, Wait) and _quick_waiter.acquire(blocking=False):
            try:
                outs = finish.within(QUICK_WAIT_S)
            except Exception:  # noqa: BLE001 - a timeout, or the collective's error: the completer delivers either
                pass  # (raised here, it would abort the step before the submits after this one, which peers made)
            else:
                return [*(np.asarray(o, dtype=d) for o, d in zip(outs, np_dtypes)), np.int64(1)]
            finally:
                _quick_waiter.release()
        _completer.put(finish, lambda outs, err: site.deliver(call, outs, err), np_dtypes)
        return [*nothing, np.int64(0)]

    def receive():
        with tf.control_dependencies([token]):
            vals = tf_queue.dequeue(name="receive")
        if not isinstance(vals, (list, tuple)):  # a queue of one component (the error id) dequeues a tensor
            vals = [vals]
        # Not stateful: tf.function chains stateful ops in program order, and a check (which waits for its
        # dequeue) before the next submit would serialise independent collectives in creation order.
        ok = tf.numpy_function(_wrap(site.check), [vals[-1]], tf.int64, stateful=False, name="check")
        return [ok, *vals[:-1]]

    with tf.name_scope(name):
        submitted = tf.numpy_function(_wrap(do_submit), [*inputs, *owned],
                                      [*(out_dtypes if quick else ()), tf.int64], stateful=True, name="submit")
        token = submitted[-1]
        if quick:  # finished in the submit op (token 1), or delivered through the queue (token 0)
            ok, *vals = tf.cond(token > 0, lambda: [token - 1, *submitted[:-1]], receive, name="finished")
        else:
            ok, *vals = receive()
        return _after(ok, [*vals, *owned])


_no_error: list = []  # the error id "none" as an eager tensor, made once by the completer thread


def _enqueue(tf_queue, outs: list, err: int) -> None:
    """The completer's delivery: the raw op with a ready-made "no error" tensor (9 us, against 39 us for
    ``FIFOQueue.enqueue`` of a numpy scalar)."""
    if err < 0:
        if not _no_error:
            _no_error.append(tf.constant(np.int64(-1)))
        code = _no_error[0]
    else:
        code = tf.constant(np.int64(err))
    tf.raw_ops.QueueEnqueueV2(handle=tf_queue.queue_ref, components=[*outs, code])


def _after(ok: tf.Tensor, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``values`` made to follow ``ok`` (always 0) at no cost: a slice of all of each, starting at ``ok``.

    The check must stay in the graph and run before the values are read.  A stateless op that only control
    edges use is pruned by Grappler, and a reshape is no anchor either: Grappler folds a chain of reshapes
    (``Reshape(Reshape(x, s1), s2) -> Reshape(x, s2)``), so a user's reshape of a result used to drop the
    check (an error then went unnoticed, and a result written into TensorFlow-owned memory was read before
    the engine wrote it).  A slice whose start comes from ``ok`` cannot be folded or proven redundant, and
    TensorFlow hands its input through as the output when it covers all of it (no copy)."""
    start = tf.reshape(tf.cast(ok, tf.int32), [1])
    outs = []
    for v in values:
        if v.shape.rank == 1:
            out = tf.slice(v, start, [-1])
        else:
            out = tf.reshape(tf.slice(tf.reshape(v, [-1]), start, [-1]), tf.shape(v))
        out.set_shape(v.shape)
        outs.append(out)
    return outs


def _receive_in_session(submit: Submit, inputs, out_dtypes, np_dtypes, name: str) -> list[tf.Tensor]:
    """In a TF1 graph: a queue in the running session, filled through that session (see _session_bridge)."""
    site, run_token = _session_bridge.new_site(out_dtypes)

    def do_submit(token, *arrays):
        run = _session_bridge.run_token(token)
        finish = submit(list(arrays))
        _completer.put(finish, lambda outs, err: _session_bridge.deliver(run, site, outs, err, int(token)),
                       np_dtypes)
        return np.int64(0)

    def check(err, token):
        _session_bridge.consumed(token, site.id)
        if err >= 0:
            error = to_tf_error(_completer.take_error(int(err)))
            _session_bridge.failed(token, error)  # Session.run restores its class (numpy_function loses it)
            raise error
        return np.int64(0)

    with tf.name_scope(name):
        submitted = tf.numpy_function(_wrap(do_submit), [run_token, *inputs], tf.int64, stateful=True,
                                      name="submit")
        with tf.control_dependencies([submitted]):
            vals = site.queue.dequeue(name="receive")
        ok = tf.numpy_function(_wrap(check), [vals[-2], vals[-1]], tf.int64, stateful=True, name="check")
        return _after(ok, vals[:-2])
