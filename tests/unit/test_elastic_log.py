"""What the elastic loop logs for an error it recovers from: its first line, not TensorFlow's whole graph."""

from __future__ import annotations

from horovod.common.elastic import _first_line
from horovod.common.exceptions import HorovodInternalError


def test_a_tensorflow_error_is_logged_by_its_first_line():
    graph = "".join(f'  File "train.py", line {i}, in step\n' for i in range(200))
    error = HorovodInternalError(f"rank 1 on host a exited or lost its connection\n\t [[{{{{node Submit}}}}]]\n"
                                 f"Detected at node Submit defined at (most recent call last):\n{graph}")
    assert _first_line(error) == "rank 1 on host a exited or lost its connection [202 more lines at debug level]"


def test_a_one_line_error_is_logged_whole():
    assert _first_line(HorovodInternalError("rank 1 exited")) == "rank 1 exited"
    assert _first_line(HorovodInternalError("")) == "HorovodInternalError('')"
