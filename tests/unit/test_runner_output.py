"""Line splitting and prefixing of worker output, fed in awkward chunks."""

import io
import os
import threading

import pytest

from horovod.runner.output import OutputSink, forward_stream


class _Collect(OutputSink):
    def __init__(self):
        super().__init__(io.StringIO())
        self.items = []

    def write(self, text):
        self.items.append(text)


def _forward(chunks, **kwargs):
    r, w = os.pipe()
    sink = _Collect()
    copy = io.BytesIO()
    copy.close = lambda: None
    with os.fdopen(r, "rb") as src:
        t = threading.Thread(target=forward_stream, args=(src, sink, 7, "stdout"),
                             kwargs={"copy_to": copy, **kwargs})
        t.start()
        for chunk in chunks:
            os.write(w, chunk)
            threading.Event().wait(0.01)   # let the reader see each chunk separately
        os.close(w)
        t.join(timeout=10)
    return sink.items, copy.getvalue()


@pytest.mark.parametrize("chunks", [
    [b"a\nb\r\nc\rd"],
    [b"a", b"\n", b"b\r", b"\nc\r", b"d"],
    [b"a\nb\r\nc\rd"[i:i + 1] for i in range(len(b"a\nb\r\nc\rd"))],
])
def test_line_endings(chunks):
    items, raw = _forward(chunks)
    assert items == ["[7]<stdout>:a\n", "[7]<stdout>:b\n", "[7]<stdout>:c\r", "[7]<stdout>:d\n"]
    assert raw == b"a\nb\r\nc\rd"


def test_utf8_split_across_reads_and_invalid_bytes():
    data = "é中€".encode()
    items, _ = _forward([data[:1], data[1:4], data[4:], b"\xff\n"])
    assert items == ["[7]<stdout>:é中€\ufffd\n"]


def test_timestamp_prefix():
    items, _ = _forward([b"x\n"], timestamp=True)
    assert items[0].endswith("[7]<stdout>:x\n") and len(items[0]) > len("[7]<stdout>:x\n") + 20


def test_empty_stream():
    assert _forward([]) == ([], b"")


_KERAS_CHUNKS = [
    b"Epoch 1/2\n1/3 [=>",                       # a whole line, then a partial one split mid-line
    b"....] - ETA: 1s",                           # the rest of the partial line, still no line end
    b"\b\b\b\r2/3 [==>...] - ETA: 0s",            # Keras' dynamic update: backspaces, \r, the next bar
    b"\b\b\b\r3/3 [====] - 1s\nEpoch 2/2\nok\n",  # the last update ends the line; more lines in one chunk
    b"no newline at EOF",
]
_TS = "Mon Dec  4 12:00:01 2023"


@pytest.mark.parametrize("timestamp", [False, True])
def test_every_line_gets_exactly_one_prefix(monkeypatch, timestamp):
    """Keras-style progress output, split mid-line: one ``[rank]<stdout>:`` (with the time) per line."""
    monkeypatch.setattr("horovod.runner.output.time.asctime", lambda *a: _TS)
    items, raw = _forward(_KERAS_CHUNKS, timestamp=timestamp)
    tag = (_TS if timestamp else "") + "[7]<stdout>:"
    assert "".join(items) == "".join(tag + line for line in [
        "Epoch 1/2\n", "1/3 [=>....] - ETA: 1s\b\b\b\r", "2/3 [==>...] - ETA: 0s\b\b\b\r", "3/3 [====] - 1s\n",
        "Epoch 2/2\n", "ok\n", "no newline at EOF\n"])
    assert all(item.count(tag) == 1 and item.startswith(tag) for item in items)
    assert raw == b"".join(_KERAS_CHUNKS)


def test_spark_relay_keeps_one_prefix_per_line(monkeypatch):
    """horovod.spark's path (task's forwarder -> Outbox -> store -> driver's _Output) adds no second prefix."""
    from horovod.spark import runner as spark_runner
    from horovod.spark import task as spark_task

    class _Store(dict):
        def put(self, key, value):
            self[key] = value

        def get(self, key, default=None):
            return dict.get(self, key, default)

        def delete(self, key):
            self.pop(key, None)

    monkeypatch.setattr("horovod.runner.output.time.asctime", lambda *a: _TS)
    monkeypatch.setattr(spark_task, "OUTPUT_CHUNK_BYTES", 1)   # every forwarded line is a chunk of its own
    store, out, err = _Store(), io.StringIO(), io.StringIO()
    outbox = spark_task.Outbox(store, lambda seq: spark_task.output_key(0, seq), "rank 0")
    r, w = os.pipe()
    with os.fdopen(r, "rb") as src:
        t = threading.Thread(target=forward_stream, args=(src, spark_task._StreamSink("stdout", outbox), 0, "stdout"),
                             kwargs={"timestamp": True})
        t.start()
        for chunk in _KERAS_CHUNKS:
            os.write(w, chunk)
            threading.Event().wait(0.01)
        os.close(w)
        t.join(timeout=10)
    outbox.close()
    spark_runner._Output(store, 1, out, err).drain()
    tag = _TS + "[0]<stdout>:"
    assert out.getvalue() == "".join(tag + line for line in [
        "Epoch 1/2\n", "1/3 [=>....] - ETA: 1s\b\b\b\r", "2/3 [==>...] - ETA: 0s\b\b\b\r", "3/3 [====] - 1s\n",
        "Epoch 2/2\n", "ok\n", "no newline at EOF\n"])
    assert err.getvalue() == ""
