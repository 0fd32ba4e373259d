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
