"""Host specs and rank assignment (HOROVOD_SPEC.md §4.2)."""

import re

import pytest

from horovod.runner.hosts import (
    INVALID_HOST_MESSAGE,
    HostInfo,
    get_host_assignments,
    is_local_host,
    parse_host_files,
    parse_hosts,
)


def test_parse_hosts():
    assert parse_hosts("host-1:2,worker.example.com:4") == [HostInfo("host-1", 2),
                                                             HostInfo("worker.example.com", 4)]
    assert parse_hosts("localhost:1") == [HostInfo("localhost", 1)]


@pytest.mark.parametrize("spec", ["host", "host:", "host:x", ":2", "host:2:3", "ho st:2", "host:-1"])
def test_parse_hosts_invalid(spec):
    with pytest.raises(ValueError) as e:
        parse_hosts(spec)
    assert str(e.value) == INVALID_HOST_MESSAGE
    assert INVALID_HOST_MESSAGE == ("Invalid host input, please make sure it has format as : "
                                    "worker-0:2,worker-1:2.")


@pytest.mark.parametrize("spec,listed,merged", [
    ("localhost:1,localhost:1", "localhost (localhost:1, localhost:1)", "localhost:2"),
    ("a:2,b:1,a:3", "a (a:2, a:3)", "a:5,b:1"),
])
def test_a_host_listed_twice_is_refused(spec, listed, merged):
    """Upstream assigns the second entry cross rank 1 of a cross size of 1: the workers fail at init."""
    with pytest.raises(ValueError) as e:
        parse_hosts(spec)
    assert str(e.value) == (f"Host listed more than once: {listed}. List each host once with all its slots, "
                            f"e.g. {merged}")


def test_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nhost1 slots=2\n\nhost2   slots=4  # big\nhost3\n")
    assert parse_host_files(str(path)) == "host1:2,host2:4,host3:1"


@pytest.mark.parametrize("line", ["localhost slots = 2", "localhost slot=2", "localhost  slots= 2 ",
                                  "localhost\tslots =2"])
def test_hostfile_slots_spelled_loosely(tmp_path, line):
    """Upstream reads the number after '=' (line.split('=')[1]): spaces around '=' and 'slot=' mean 2 slots,
    not 1 with the field ignored."""
    path = tmp_path / "hosts"
    path.write_text(f"{line}\n127.0.0.1 slots=3\n")
    assert parse_host_files(str(path)) == "localhost:2,127.0.0.1:3"


@pytest.mark.parametrize("line,text", [("localhost slots=x", "Invalid slot count"),
                                       ("localhost max-slots=2", "Invalid field"),
                                       ("localhost slots=2 extra", "Invalid field"),
                                       ("localhost 2", "Invalid field"),
                                       ("localhost:2", "Invalid host")])
def test_hostfile_unparseable_line_is_named(tmp_path, line, text):
    path = tmp_path / "hosts"
    path.write_text(f"# cluster\n{line}\n")
    with pytest.raises(ValueError, match=re.escape(f"{text} in hostfile '{path}' line 2: '{line}'; ")):
        parse_host_files(str(path))


def _reference(slots_per_host, np):
    """Independent model: fill hosts in order; cross rank = position among hosts having that local rank."""
    out, rank = [], 0
    for h, n in enumerate(slots_per_host):
        for lr in range(n):
            if rank == np:
                break
            out.append((f"h{h}", rank, lr))
            rank += 1
    result = []
    for host, r, lr in out:
        hosts_with_lr = [x[0] for x in out if x[2] == lr]
        local_size = sum(1 for x in out if x[0] == host)
        result.append((host, r, lr, local_size, hosts_with_lr.index(host), len(hosts_with_lr), len(out)))
    return result


@pytest.mark.parametrize("np", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", [[5], [3, 2], [2, 2, 1], [1, 1, 3], [2, 3, 2]])
def test_assignments(np, layout):
    hosts = [HostInfo(f"h{i}", n) for i, n in enumerate(layout)]
    slots = get_host_assignments(hosts, np, np)
    got = [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.size)
           for s in slots]
    assert got == _reference(layout, np)


def test_assignments_examples():
    slots = get_host_assignments(parse_hosts("a:2,b:2,c:1"), 5)
    assert [(s.rank, s.local_rank, s.cross_rank, s.cross_size, s.local_size) for s in slots] == [
        (0, 0, 0, 3, 2), (1, 1, 0, 2, 2), (2, 0, 1, 3, 2), (3, 1, 1, 2, 2), (4, 0, 2, 3, 1)]
    assert slots[0].to_env() == {
        "HOROVOD_HOSTNAME": "a", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "5", "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "3"}


def test_no_max_launches_every_slot():
    assert len(get_host_assignments(parse_hosts("a:2,b:2"), 1)) == 4
    assert len(get_host_assignments(parse_hosts("a:2,b:2"), 1, 3)) == 3


def test_keyword_names_are_upstreams():
    # upstream's signature is get_host_assignments(hosts, min_num_proc, max_num_proc=None); its own tests call it
    # by keyword: worker-0:2,worker-1:2 with min 1, max 2 gives both ranks on worker-0, cross size 1
    slots = get_host_assignments(parse_hosts("worker-0:2,worker-1:2"), min_num_proc=1, max_num_proc=2)
    assert [(s.hostname, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size, s.cross_size)
            for s in slots] == [("worker-0", 0, 0, 0, 2, 2, 1), ("worker-0", 1, 1, 0, 2, 2, 1)]
    # the names of upstream's earlier releases (and of its tests then)
    assert get_host_assignments(parse_hosts("worker-0:2,worker-1:2"), min_np=1, max_np=2) == slots
    with pytest.raises(TypeError):
        get_host_assignments(parse_hosts("a:1"), 1, min_np=1)


def test_too_few_slots():
    expected = r"^Requested more processes \(4\) than there are available slots \(3\)$"
    with pytest.raises(ValueError, match=expected):
        get_host_assignments(parse_hosts("a:1,b:2"), 4)


def test_is_local_host():
    assert is_local_host("localhost")
    assert is_local_host("127.0.0.1")
    assert not is_local_host("no-such-host.invalid")
    assert not is_local_host("10.255.255.1", _local={"127.0.0.1"})
    assert is_local_host("10.255.255.1", _local={"10.255.255.1"})
