"""``--tls`` across network-namespace hosts, watched by an on-path observer (see conftest.py).

The root namespace is the bridge between the hosts, so a packet socket there sees every frame between them:
what an attacker on the network path sees.  A ``horovod.run`` job is started from hvdh1 with two ranks on
each of hvdh2 and hvdh3 (shared memory inside a host, TCP between them: the hierarchical path).  A random
marker travels every way data can: inside the pickled function and arguments the launcher puts in the
rendezvous store, in the results the workers put back, in the raw bytes of allgather and broadcast tensors,
in a small allreduce that rides inline on the control channels, and in a ``broadcast_object`` pickle.  The
observer reassembles every TCP stream it saw between the hosts and searches them.

* without TLS the marker is on the wire (so the search works and the test can fail);
* with ``HOROVOD_TLS=1`` (what ``horovodrun --tls`` sets) the results are correct, every cross-host channel
  is TLS, and the marker appears in none of the streams -- neither the store's nor the mesh's.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import textwrap
import threading

import pytest

pytestmark = pytest.mark.timeout(180)
pytest.importorskip("cryptography", reason="pip install 'horovod[tls]'")

JOB = textwrap.dedent("""
    import json, sys
    import horovod

    def work(marker):
        import numpy as np
        import horovod.numpy as hvd
        from horovod.common import basics
        hvd.init()
        r, size = hvd.rank(), hvd.size()
        raw = np.frombuffer(marker * 4096, np.uint8)
        g = hvd.allgather(raw.copy(), name="marker.gather")            # raw bytes of every rank
        assert g.tobytes() == marker * 4096 * size
        b = hvd.broadcast(raw.copy() if r == size - 1 else np.zeros_like(raw), root_rank=size - 1, name="b")
        assert b.tobytes() == marker * 4096
        small = hvd.allreduce(np.frombuffer(marker * 8, np.uint8).copy(), op=hvd.Max, name="inline")
        assert small.tobytes() == marker * 8                             # inline through rank 0's control channel
        obj = hvd.broadcast_object({"from": r, "marker": marker}, root_rank=size - 1)
        assert obj == {"from": size - 1, "marker": marker}
        n = 1 << 20
        x = (np.arange(n) % 7 + r).astype(np.float32)
        total = hvd.allreduce(x, op=hvd.Sum, name="big")
        np.testing.assert_array_equal(total, (np.arange(n) % 7 * size + size * (size - 1) // 2).astype(np.float32))
        mesh = basics.engine().mesh  # before any rank may shut down (that ends the job everywhere)
        cross = [type(ch).__name__ for p, ch in mesh.data.items() if mesh.hostnames[p] != mesh.hostnames[r]]
        backend = type(basics.engine()._communicator(0)).__name__
        hvd.barrier()
        hvd.shutdown()
        return {"rank": r, "marker": marker, "cross": cross, "backend": backend}

    marker = bytes.fromhex(sys.argv[1])
    results = horovod.run(work, args=(marker,), np=4, hosts="hvdh2:2,hvdh3:2", ssh_port=int(sys.argv[2]),
                          ssh_identity_file=sys.argv[3])
    print("RESULTS " + json.dumps([{**r, "marker": r["marker"].hex()} for r in results]), flush=True)
""")

_ETH_P_ALL = 0x0003


class _Observer(threading.Thread):
    """Every TCP segment between the namespace hosts, as seen from the bridge (root namespace)."""

    def __init__(self, prefix: bytes) -> None:
        super().__init__(daemon=True)
        self.prefix = prefix  # the hosts' /24, as the first three bytes of an IPv4 address
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE (root): no drops
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.settimeout(0.2)
        self.segments: dict[tuple, dict[int, bytes]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                frame = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            self._add(frame)

    def _add(self, frame: bytes) -> None:
        if len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00":
            return
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        if ip[9] != 6 or ip[12:15] != self.prefix or ip[16:19] != self.prefix:
            return
        tcp = ip[ihl:total]
        if len(tcp) < 20:
            return
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4:]
        if payload:
            flow = (bytes(ip[12:16]), sport, bytes(ip[16:20]), dport)
            segs = self.segments.setdefault(flow, {})
            if len(payload) > len(segs.get(seq, b"")):  # the same segment is seen on two bridge ports
                segs[seq] = bytes(payload)

    def stop(self) -> dict[tuple, bytes]:
        """Stop, and return each flow's bytes in sequence order."""
        self.halt.set()
        self.join(5)
        drops = 0
        try:  # PACKET_STATISTICS: (packets, drops)
            drops = struct.unpack("II", self.sock.getsockopt(263, 6, 8))[1]
        except OSError:
            pass
        self.sock.close()
        self.drops = drops
        streams = {}
        for flow, segs in self.segments.items():
            first = min(segs)
            streams[flow] = b"".join(segs[s] for s in sorted(segs, key=lambda s: (s - first) % (1 << 32)))
        return streams


def _run_job(netns_hosts, tmp_path, tls: bool) -> tuple[list[dict], dict[tuple, bytes], bytes, _Observer]:
    marker = b"\x8b\x01MARK" + os.urandom(8) + b"ER\x02"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    prefix = socket.inet_aton(netns_hosts.bridge_addr)[:3]
    observer = _Observer(prefix)
    observer.start()
    try:
        proc = netns_hosts.run_in("hvdh1", [sys.executable, str(script), marker.hex(), str(netns_hosts.port),
                                            netns_hosts.key], timeout=150,
                                  env_extra={"HOROVOD_TLS": "1" if tls else "0"})
    finally:
        streams = observer.stop()
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):]), streams, marker, observer


def _between(streams: dict[tuple, bytes], a: str, b: str) -> int:
    ips = {socket.inet_aton(a), socket.inet_aton(b)}
    return sum(len(data) for (src, _, dst, _), data in streams.items() if {src, dst} == ips)


def test_plain_job_is_readable_on_the_path(netns_hosts, tmp_path):
    """The observer works: without TLS the marker shows in the store's and in the mesh's streams."""
    results, streams, marker, _ = _run_job(netns_hosts, tmp_path, tls=False)
    assert [r["marker"] for r in results] == [marker.hex()] * 4
    assert all(set(r["cross"]) == {"Channel"} for r in results), results
    store_addr = socket.inet_aton("10.213.0.11")
    hits = [(src == store_addr or dst == store_addr) for (src, _, dst, _), data in streams.items() if marker in data]
    assert True in hits, "marker not seen in the store's traffic"   # pickled function and results
    assert False in hits, "marker not seen in the mesh's traffic"   # tensors and pickles between ranks


def test_tls_job_across_hosts_correct_and_opaque(netns_hosts, tmp_path):
    results, streams, marker, observer = _run_job(netns_hosts, tmp_path, tls=True)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["marker"] for r in results] == [marker.hex()] * 4
    assert all(r["backend"] == "HierarchicalCommunicator" for r in results), results
    # The observer saw the job (megabytes between the ranks' hosts, the store's traffic) ...
    assert _between(streams, "10.213.0.12", "10.213.0.13") > 2 << 20
    assert _between(streams, "10.213.0.11", "10.213.0.12") > 1000
    assert observer.drops == 0, f"the observer dropped {observer.drops} packets"
    # ... and none of it in clear.
    store_addr = socket.inet_aton("10.213.0.11")
    leaked = sorted({"store" if store_addr in (src, dst) else "mesh"
                     for (src, _, dst, _), data in streams.items() if marker in data or marker[:8] in data})
    assert not leaked, f"marker in clear in the {' and '.join(leaked)} traffic"
    assert all(r["cross"] and set(r["cross"]) == {"TlsChannel"} for r in results), results
