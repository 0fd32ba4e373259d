"""The Chrome-trace timeline writer (HOROVOD_SPEC §2.8): valid JSON after every write, upstream's records."""

from __future__ import annotations

import json

import pytest

from horovod.runtime.messages import RequestType
from horovod.runtime.timeline import Timeline


@pytest.fixture
def checked_timeline(monkeypatch):
    """A Timeline whose writer re-parses the whole file after every single record it writes."""
    problems: list[str] = []
    writes = [0]
    original = Timeline._write

    def checking_write(self, record):
        original(self, record)
        writes[0] += 1
        with open(self._file.name, "rb") as f:
            text = f.read()
        try:
            json.loads(text)
        except ValueError as e:
            problems.append(f"after write {writes[0]}: {e}: {text[-200:]!r}")

    monkeypatch.setattr(Timeline, "_write", checking_write)
    timelines: list[Timeline] = []

    def make(mark_cycles=False):
        t = Timeline(mark_cycles)
        timelines.append(t)
        return t

    yield make, problems, writes
    for t in timelines:
        t.close()


def _load(path):
    with open(path) as f:
        return json.load(f)


def _record_one_allreduce(t, name="allreduce.test_allreduce", ranks=(0, 1)):
    t.negotiate_start(name, RequestType.ALLREDUCE)
    for r in ranks:
        t.negotiate_rank_ready(name, r)
    t.negotiate_end(name)
    t.begin(name, "ALLREDUCE")
    t.begin(name, "GLOO_ALLREDUCE")
    t.end(name)
    t.end(name, {"dtype": "float32", "shape": "[3]"})


def test_file_valid_after_every_write(tmp_path, checked_timeline):
    make, problems, writes = checked_timeline
    t = make(mark_cycles=True)
    path = tmp_path / "timeline.json"
    t.start(str(path))
    for i in range(5):
        t.mark_cycle()
        _record_one_allreduce(t, f"allreduce.t{i}", ranks=(0, 1, 2))
    t.stop()
    assert writes[0] > 40
    assert problems == []
    assert isinstance(_load(path), list)


def test_metadata_records(tmp_path, checked_timeline):
    make, problems, _ = checked_timeline
    t = make()
    path = tmp_path / "t.json"
    t.start(str(path))
    _record_one_allreduce(t, "allreduce.test_allreduce")
    _record_one_allreduce(t, "allreduce.second")
    _record_one_allreduce(t, "allreduce.test_allreduce")
    t.stop()
    text = path.read_text()
    assert text.startswith('[\n{"name": "process_name", "ph": "M", "pid": 0, "args": '
                           '{"start_time_since_epoch_in_micros": ')
    lines = text.split("\n")
    assert lines[0] == "["
    assert lines[-1] == "]"
    assert lines[2] == '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},'
    records = _load(path)
    assert isinstance(records[0]["args"]["start_time_since_epoch_in_micros"], int)
    assert records[0]["args"]["start_time_since_epoch_in_micros"] > 1_500_000_000_000_000
    # Each tensor name gets pid 1, 2, ... in order of first appearance, announced once.
    names = [r for r in records if r.get("name") == "process_name" and r["pid"] != 0]
    assert [(r["pid"], r["args"]["name"]) for r in names] == [(1, "allreduce.test_allreduce"), (2, "allreduce.second")]
    sorts = [r for r in records if r.get("name") == "process_sort_index" and r["pid"] != 0]
    assert [(r["pid"], r["args"]) for r in sorts] == [(1, {"sort_index": 1}), (2, {"sort_index": 2})]
    for r in names + sorts:
        assert r["ph"] == "M"
    assert problems == []


def test_event_records(tmp_path, checked_timeline):
    make, _, _ = checked_timeline
    t = make()
    path = tmp_path / "t.json"
    t.start(str(path))
    _record_one_allreduce(t, "allreduce.x", ranks=(0, 1))
    t.stop()
    events = [r for r in _load(path) if r["ph"] != "M"]
    begins = [e for e in events if e["ph"] == "B"]
    assert [e["name"] for e in begins] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "GLOO_ALLREDUCE"]
    for e in begins:
        assert set(e) == {"ph", "name", "ts", "pid"}
        assert e["pid"] == 1
    ticks = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in ticks] == ["0", "1"]
    for e in ticks:
        assert e["dur"] == 0 and e["pid"] == 1 and isinstance(e["ts"], int)
    ends = [e for e in events if e["ph"] == "E"]
    assert len(ends) == 3
    for e in ends:
        assert "name" not in e
        assert e["pid"] == 1
    assert ends[-1]["args"] == {"dtype": "float32", "shape": "[3]"}
    assert "args" not in ends[0]
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts) and ts[0] >= 0


def test_alias_registered_after_a_remote_request_still_draws_member_rows(tmp_path, checked_timeline):
    """Rank 1 submits a torch bucket before rank 0 has built (and registered) it: its tick and the opening of
    the negotiation are held until rank 0's own request, then drawn on the members' rows with their times."""
    make, _, _ = checked_timeline
    t = make()
    path = tmp_path / "t.json"
    t.start(str(path))
    t.negotiate_start("allreduce.bucket", RequestType.ALLREDUCE)
    t.negotiate_rank_ready("allreduce.bucket", 1, RequestType.ALLREDUCE)
    t.show_as("allreduce.bucket", ("allreduce.a", "allreduce.b"))
    t.negotiate_rank_ready("allreduce.bucket", 0, RequestType.ALLREDUCE)
    t.negotiate_end("allreduce.bucket")
    t.begin("allreduce.bucket", "ALLREDUCE")
    t.end("allreduce.bucket")
    # a name nobody aliases, submitted by rank 1 first, and one whose negotiation ends without rank 0
    # (a process set rank 0 is not in): both still get their own row, bars balanced
    for name, ranks in (("allreduce.plain", (1, 0)), ("allreduce.elsewhere", (1, 2))):
        t.negotiate_start(name, RequestType.ALLREDUCE)
        for r in ranks:
            t.negotiate_rank_ready(name, r, RequestType.ALLREDUCE)
        t.negotiate_end(name)
    t.stop()
    records = _load(path)
    rows = {r["pid"]: r["args"]["name"] for r in records if r.get("name") == "process_name" and r["pid"]}
    assert sorted(rows.values()) == ["allreduce.a", "allreduce.b", "allreduce.elsewhere", "allreduce.plain"]
    events = [r for r in records if r["ph"] != "M"]
    negotiated = [("B", "NEGOTIATE_ALLREDUCE"), ("X", "1"), ("X", "0"), ("E", None)]
    expected = {"allreduce.a": negotiated + [("B", "ALLREDUCE"), ("E", None)],
                "allreduce.plain": negotiated,
                "allreduce.elsewhere": [("B", "NEGOTIATE_ALLREDUCE"), ("X", "1"), ("X", "2"), ("E", None)]}
    expected["allreduce.b"] = expected["allreduce.a"]
    for pid, name in rows.items():
        mine = [e for e in events if e["pid"] == pid]
        assert [(e["ph"], e.get("name")) for e in mine] == expected[name], (name, mine)
        ts = [e["ts"] for e in mine]
        assert ts == sorted(ts), (name, mine)


def test_cycle_markers_only_when_enabled(tmp_path, checked_timeline):
    make, _, _ = checked_timeline
    on, off = make(mark_cycles=True), make(mark_cycles=False)
    p_on, p_off = tmp_path / "on.json", tmp_path / "off.json"
    on.start(str(p_on))
    off.start(str(p_off))
    on.mark_cycle()
    off.mark_cycle()
    on.stop()
    off.stop()
    marks = [r for r in _load(p_on) if r.get("name") == "CYCLE_START"]
    assert len(marks) == 1
    assert marks[0]["ph"] == "i" and marks[0]["s"] == "g" and isinstance(marks[0]["ts"], int)
    assert not [r for r in _load(p_off) if r.get("name") == "CYCLE_START"]


def test_inactive_timeline_records_nothing(tmp_path, checked_timeline):
    make, _, writes = checked_timeline
    t = make()  # DYNAMIC: enabled, no file yet
    assert not t.active
    _record_one_allreduce(t)
    path = tmp_path / "later.json"
    t.start(str(path))
    assert t.active
    t.stop()
    assert not t.active
    records = _load(path)
    assert len(records) == 2  # only the file's own metadata
    assert writes[0] == 2


def test_dynamic_restart_writes_a_fresh_file(tmp_path, checked_timeline):
    make, problems, _ = checked_timeline
    t = make()
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    t.start(str(first))
    _record_one_allreduce(t, "allreduce.a")
    t.stop()
    t.start(str(second), mark_cycles=True)
    _record_one_allreduce(t, "allreduce.b")
    t.mark_cycle()
    t.stop()
    r1, r2 = _load(first), _load(second)
    assert any(r.get("args", {}).get("name") == "allreduce.a" for r in r1)
    assert not any(r.get("args", {}).get("name") == "allreduce.b" for r in r1)
    assert r2[0]["args"].keys() == {"start_time_since_epoch_in_micros"}
    # pids restart at 1 in the new file, and the new name is announced there
    named = [r for r in r2 if r.get("name") == "process_name" and r["pid"] != 0]
    assert [(r["pid"], r["args"]["name"]) for r in named] == [(1, "allreduce.b")]
    assert any(r.get("name") == "CYCLE_START" for r in r2)
    assert problems == []


def test_name_seen_before_a_restart_is_announced_again(tmp_path, checked_timeline):
    make, _, _ = checked_timeline
    t = make()
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    t.start(str(first))
    _record_one_allreduce(t, "allreduce.same")
    t.stop()
    t.start(str(second))
    _record_one_allreduce(t, "allreduce.same")
    t.stop()
    records = _load(second)
    pids = {r["pid"] for r in records if r["ph"] != "M"}
    announced = {r["pid"] for r in records if r.get("name") == "process_name"}
    assert pids <= announced, "events refer to a pid whose process_name record is not in this file"


def test_special_characters_in_names(tmp_path, checked_timeline):
    make, problems, _ = checked_timeline
    t = make()
    path = tmp_path / "t.json"
    t.start(str(path))
    weird = 'allreduce.we"ird\\name\n\u00e9'
    _record_one_allreduce(t, weird)
    t.stop()
    assert any(r.get("args", {}).get("name") == weird for r in _load(path))
    assert problems == []


def test_close_is_idempotent_enough(tmp_path):
    t = Timeline()
    t.start(str(tmp_path / "x.json"))
    t.close()
    assert not t.active
    assert json.loads((tmp_path / "x.json").read_text())


def test_a_file_that_cannot_be_opened_is_the_callers_error(tmp_path, checked_timeline):
    """hvd.start_timeline() of a bad path raises (upstream logged and recorded nothing); a later good one works."""
    make, problems, _ = checked_timeline
    t = make()
    with pytest.raises(FileNotFoundError):
        t.start(str(tmp_path / "missing" / "t.json"))
    assert not t.active
    _record_one_allreduce(t, "allreduce.lost")  # recorded nowhere, and no error
    good = tmp_path / "t.json"
    t.start(str(good))
    _record_one_allreduce(t, "allreduce.kept")
    t.stop()
    assert [r["args"]["name"] for r in _load(good) if r.get("name") == "process_name" and r["pid"]] == \
        ["allreduce.kept"]
    assert problems == []


@pytest.mark.parametrize("knobs,problem", [
    ({"HOROVOD_TIMELINE": "{tmp}/missing/t.json"}, "HOROVOD_TIMELINE='{tmp}/missing/t.json' cannot be written by "
                                                   "rank 0: no directory {tmp}/missing"),
    ({"HOROVOD_TIMELINE": "{tmp}"}, "HOROVOD_TIMELINE='{tmp}' cannot be written by rank 0: it is a directory"),
    ({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "{tmp}/no/a.csv"}, "HOROVOD_AUTOTUNE_LOG="),
])
def test_rank_0_refuses_output_files_it_cannot_write(tmp_path, knobs, problem):
    from horovod.base.config import EnvVarError, read_runtime_config
    from horovod.runtime.engine import check_output_files

    config = read_runtime_config({k: v.format(tmp=tmp_path) for k, v in knobs.items()})
    with pytest.raises(EnvVarError) as e:
        check_output_files(config, rank=0)
    assert str(e.value).startswith(problem.format(tmp=tmp_path))
    check_output_files(config, rank=1)  # only rank 0 writes them
    for fine in ({"HOROVOD_TIMELINE": "DYNAMIC"}, {"HOROVOD_TIMELINE": str(tmp_path / "t.json")},
                 {"HOROVOD_AUTOTUNE_LOG": str(tmp_path / "no" / "a.csv")}):  # the log is not used without autotune
        check_output_files(read_runtime_config(fine), rank=0)
