"""The DRE service in its own process: same labels as in-process ReSV and Mosaic, shared
memory (or inline tensors across IPC namespaces) and JSON only, batching,
shared-secret auth, death and restart."""

from __future__ import annotations

import socket

import pytest
import torch

from kvreel.dre.client import DREClient, DREProcess
from kvreel.dre.wire import DREError, put_tensor, take_tensor
from kvreel.dre.resv import cluster_keys, hyperplanes


def data(T=600, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(16, D, generator=g) * 2
    return centers[torch.randint(0, 16, (T,), generator=g)] + 0.5 * torch.randn(T, D, generator=g)


@pytest.fixture
def dre(tmp_path):
    proc = DREProcess(str(tmp_path / "dre.sock"), bits=12, hamming=1)
    client = proc.start()
    yield proc, client
    client.close()
    proc.stop()


def expected_table(keys, center=None):
    """In process: ReSV's HC table (the service's settings above)."""
    return cluster_keys(keys, hyperplanes(keys.shape[1], 12, seed=1), 1, center)


def expected_labels(keys, center=None):
    return expected_table(keys, center).labels


def test_service_labels_exactly_what_resv_computes_in_process(dre):
    _, client = dre
    keys = data()
    reply = client.submit("cluster", handle="s0/3", keys=keys).result(10)
    want = expected_table(keys)
    assert torch.equal(reply["labels"], want.labels.unsqueeze(0))
    assert reply["clusters"] == int(want.labels.max()) + 1
    assert reply["table_bytes"] == want.nbytes == 600 * 8 + want.num_clusters * (64 * 4 + 8 + 8) + 64 * 4


def test_heads_are_clustered_separately(dre):
    _, client = dre
    k0, k1 = data(seed=1), data(seed=2)
    got = client.submit("cluster", handle="two", keys=torch.stack([k0, k1])).result(10)["labels"]
    assert torch.equal(got[0], expected_labels(k0)) and torch.equal(got[1], expected_labels(k1))


def test_requests_in_flight_together_are_all_answered(dre):
    _, client = dre
    futs = [(client.submit("cluster", handle=f"h{i}", keys=data(seed=i)), data(seed=i)) for i in range(12)]
    for fut, keys in futs:
        assert torch.equal(fut.result(20)["labels"][0], expected_labels(keys))


def test_bad_requests_get_clear_errors_and_do_not_stop_the_service(dre, tmp_path):
    _, client = dre
    with pytest.raises(DREError, match="unknown handle"):
        client.submit("extend", handle="nope", keys=data(T=32)).result(10)
    with pytest.raises(DREError, match="unknown op"):
        client.submit("unpickle").result(10)
    with pytest.raises(DREError, match="cluster wants method"):
        client.submit("cluster", handle="x", keys=data(T=32), method="kmeans").result(10)
    raw = socket.socket(socket.AF_UNIX)            # a peer that sends an oversized header
    raw.connect(str(tmp_path / "dre.sock"))
    raw.sendall((1 << 30).to_bytes(4, "little") + bytes(4))
    raw.close()
    assert client.submit("ping").result(10)["ok"]


def test_shared_secret_is_required_and_checked(tmp_path):
    proc = DREProcess(str(tmp_path / "s.sock"), secret=b"correct horse battery")
    client = proc.start()
    try:
        assert client.submit("ping").result(10)["ok"]
        with pytest.raises(DREError, match="requires a shared secret"):
            DREClient(str(tmp_path / "s.sock"))
        with pytest.raises(DREError, match="refused the shared secret"):
            DREClient(str(tmp_path / "s.sock"), secret=b"wrong")
    finally:
        client.close()
        proc.stop()


@pytest.mark.parametrize("bad, why", [("abcd", "needs at least 32 hex digits, got 4"),
                                       ("zz" * 16, "is not an even number of hex digits")])
def test_the_service_refuses_a_malformed_secret_in_one_line(tmp_path, bad, why):
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "kvreel.dre.service", "--address", str(tmp_path / "s.sock")],
                         env=dict(os.environ, KVREEL_DRE_SECRET_HEX=bad), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == f"kvreel dre: KVREEL_DRE_SECRET_HEX {why}", out.stderr
    assert not (tmp_path / "s.sock").exists()


def test_a_dead_service_fails_pending_requests_and_is_restarted(dre):
    proc, client = dre
    keys = data()
    client.submit("cluster", handle="h", keys=keys[:320]).result(10)
    proc.proc.kill()
    proc.proc.wait(timeout=30)
    with pytest.raises(DREError, match="died|gone|unreachable"):
        client.submit("extend", handle="h", keys=keys[320:]).result(10)
    assert not client.alive
    proc.stop()
    fresh = proc.start()
    assert fresh.submit("ping").result(10)["ok"]
    with pytest.raises(DREError, match="unknown handle"):     # state is gone: the caller re-clusters
        fresh.submit("extend", handle="h", keys=keys[320:]).result(10)
    fresh.close()


def listening_addresses(port: int) -> set[str]:
    """IPv4 addresses listening on ``port``, from /proc/net/tcp."""
    out = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


def test_kvreel_dre_over_tcp_binds_loopback_by_default():
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvreel.cli.main", "dre",
                             "--address", f":{port}"], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        assert listening_addresses(port) == {"127.0.0.1"}
        client = DREClient(f"127.0.0.1:{port}")
        assert client.submit("ping").result(10)["ok"]
        client.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_service_in_another_ipc_namespace_gets_tensors_inline(dre):
    """A DRE in a container of its own cannot open the worker's shared memory:
    tensors then travel inline on the socket, both ways, with the same answers."""
    import os
    import subprocess
    import sys
    _, local = dre
    assert not local.inline                       # same namespace: shared memory
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["unshare", "--ipc", sys.executable, "-m", "kvreel.cli.main", "dre",
                             "--address", f"127.0.0.1:{port}", "--bits", "12", "--hamming", "1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        client = DREClient(f"127.0.0.1:{port}")
        assert client.inline
        keys = data()
        def ours() -> set[str]:                    # (tests running beside this one make their own)
            return _segments(os.getpid()) | _segments(proc.pid)
        before = ours()
        reply = client.submit("cluster", handle="x", keys=keys[:320]).result(10)
        more = client.submit("extend", handle="x", keys=keys[320:]).result(10)
        got = torch.cat([reply["labels"], more["labels"]], 1)
        assert torch.equal(got, expected_labels(keys, center=keys[:320].mean(0)).unsqueeze(0))
        assert ours() == before                         # nothing went through shared memory
        client.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_shared_memory_descriptors_are_checked():
    desc = put_tensor(torch.arange(10))
    assert torch.equal(take_tensor(desc), torch.arange(10))
    with pytest.raises(FileNotFoundError):       # taken once: the segment is gone
        take_tensor(desc)
    bad = put_tensor(torch.zeros(4))
    with pytest.raises(DREError, match="smaller than its descriptor"):
        take_tensor({**bad, "shape": [1 << 20]})
    with pytest.raises(DREError, match="bad tensor descriptor"):
        take_tensor({**bad, "dtype": "object"})
    with pytest.raises(DREError, match="inline tensor outside its frame"):
        take_tensor({"at": 4, "shape": [2], "dtype": "float32"}, bytes(8))


def _segments(pid: int | None = None) -> set[str]:
    import glob
    import os
    return {os.path.basename(p) for p in glob.glob(f"/dev/shm/kvreel-dre-*-{pid}-*" if pid else "/dev/shm/kvreel-dre-*")}


def test_segments_left_by_a_process_that_died_are_discarded_by_the_next_dre_start(tmp_path):
    """A worker or DRE killed with messages in flight leaves their shared memory
    behind (it would hold that memory until the host restarts): starting a DRE
    unlinks the segments whose creator is gone, and only those."""
    import os
    import subprocess
    import sys
    from multiprocessing import shared_memory

    from kvreel.dre.wire import discard_orphaned_segments
    dead = subprocess.run([sys.executable, "-c", "import os, torch\n"
                           "from kvreel.dre.wire import put_tensor\n"
                           "print(put_tensor(torch.arange(1000))['shm'], os.getpid(), flush=True); os._exit(0)"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert dead[0] in _segments(int(dead[1]))                      # left behind
    mine = put_tensor(torch.arange(8))["shm"]
    elsewhere = shared_memory.SharedMemory(name=f"kvreel-dre-1-{dead[1]}-{'0' * 16}", create=True, size=8)
    try:
        proc = DREProcess(str(tmp_path / "dre.sock"))
        proc.start().close()
        proc.stop()
        names = _segments()
        assert dead[0] not in names
        assert mine in names                   # its creator is alive: its receiver may still take it
        assert elsewhere.name in names         # another PID namespace's: its pids are not ours to judge
        assert discard_orphaned_segments(also=os.getpid()) >= 1 and mine not in _segments()
    finally:
        elsewhere.close()
        elsewhere.unlink()


def test_a_request_the_dre_never_took_leaves_no_shared_memory(dre):
    """A DRE that dies before it reads a request: the request fails, and the
    segments that carried its tensors are unlinked by the worker."""
    import os
    import signal
    proc, client = dre
    os.kill(proc.proc.pid, signal.SIGSTOP)                 # it reads nothing more
    before = _segments(os.getpid())
    fut = client.submit("cluster", handle="gone", keys=data())
    sent = _segments(os.getpid()) - before
    assert len(sent) == 1
    proc.proc.kill()
    with pytest.raises(DREError, match="died"):
        fut.result(30)
    assert not sent & _segments(os.getpid())


def test_mosaic_tables_label_what_the_index_holds_in_process(dre):
    from kvreel.dre.mosaic import MosaicSession
    _, client = dre
    keys = data(T=256)
    reply = client.submit("cluster", handle="m", keys=keys, method="mosaic", segment=32).result(30)
    assert torch.equal(reply["labels"][0], MosaicSession.build(keys.float(), 32).index.owners(len(keys)))


def test_extended_tables_label_as_tables_of_the_whole_history(dre):
    from kvreel.dre.mosaic import MosaicSession
    _, client = dre
    keys = data(T=608)
    labels = [client.submit("cluster", handle="r", keys=keys[:320])]
    for start in range(320, 608, 32):                       # a session growing block by block
        labels.append(client.submit("extend", handle="r", keys=keys[start:start + 32]))
    want = expected_table(keys, center=keys[:320].mean(0))    # centred as first seen
    assert torch.equal(torch.cat([f.result(10)["labels"] for f in labels], 1)[0], want.labels)
    assert labels[-1].result(10)["table_bytes"] == want.nbytes      # what the service holds, grown
    with pytest.raises(DREError, match="unknown handle 'nope'"):
        client.submit("extend", handle="nope", keys=keys[:32]).result(10)
    with pytest.raises(DREError, match="keys of 1 heads"):
        client.submit("extend", handle="r", keys=torch.stack([keys[:32], keys[:32]])).result(10)

    built = client.submit("cluster", handle="m", keys=keys[:320], method="mosaic", segment=32)
    new = client.submit("extend", handle="m", keys=keys[320:]).result(30)
    session = MosaicSession.build(keys[:320], 32)
    assert built.result(30)["table_bytes"] == session.nbytes
    session.extend(keys[320:])
    assert torch.equal(new["labels"][0], session.index.owners(608)[320:])
    # its keys, their clusters' sums and token lists: more than the keys alone, grown with them
    assert new["table_bytes"] == session.nbytes > 608 * 64 * 4 > built.result(30)["table_bytes"]


def test_mosaic_splits_pending_on_fetched_clusters_are_applied(dre):
    """A cluster whose spread grew (two groups of new tokens on either side of it)
    is split once the worker says it has been reading it (Mosaic's deferred
    split), and the reply carries every token's new label; a cluster with a
    pending split that nobody reads stays whole."""
    from kvreel.dre.mosaic import MosaicSession
    _, client = dre
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 64, generator=g) * 2
    base = centers[torch.randint(0, 4, (320,), generator=g)] + 0.3 * torch.randn(320, 64, generator=g)
    d = torch.nn.functional.normalize(torch.randn(64, generator=g), dim=0)
    side = torch.where(torch.arange(96) % 2 == 0, 1.0, -1.0).unsqueeze(1)
    new = centers[0] + side * 0.3 * d + 0.05 * torch.randn(96, 64, generator=g)
    client.submit("cluster", handle="m", keys=base, method="mosaic", segment=32)
    session = MosaicSession.build(base, 32)
    session.extend(new[:64])
    pending = [i for i, c in enumerate(session.index.clusters) if c.split_pending]
    assert pending                                            # the data leaves one to split
    unread = torch.tensor([[i for i in range(len(session.index.clusters)) if i not in pending]])
    assert "relabelled" not in client.submit("extend", handle="m", keys=new[:64], fetched=unread).result(30)
    before = session.index.owners(384)
    reply = client.submit("extend", handle="m", keys=new[64:], fetched=torch.tensor([pending])).result(30)
    session.extend(new[64:])
    session.after_fetch(torch.tensor(pending))
    assert torch.equal(reply["relabelled"][0], session.index.owners(416))
    assert not torch.equal(reply["relabelled"][0, :384], before)
    with pytest.raises(DREError, match="fetched wants cluster ids"):
        client.submit("extend", handle="m", keys=new[:0], fetched=torch.tensor([1, 2])).result(30)


def test_a_dre_started_by_a_worker_never_outlives_it(tmp_path):
    import subprocess
    import sys
    import time
    code = ("import sys; from kvreel.dre.client import DREProcess\n"
            f"p = DREProcess({str(tmp_path / 'dre.sock')!r}); p.start(); print(p.proc.pid, flush=True)\n"
            "import os; os._exit(0)   # the worker dies without cleaning up\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "State:\tZ" in f.read():        # exited, not yet reaped by init
                    break
        except FileNotFoundError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"DRE {pid} outlived its parent")


@pytest.mark.parametrize("address,charged", [(None, True), ("/run/kvreel/dre.sock", True), ("127.0.0.1:7000", True),
                                             ("192.0.2.7:7000", False)])
def test_the_dres_tables_are_charged_where_it_shares_the_workers_host(address, charged):
    """The DRE's tables count against the host budget when the DRE runs on this
    host (the worker's child, a Unix socket, loopback), not when it runs elsewhere
    (the charge itself: ``test_a_long_history_is_narrowed_by_the_dres_clusters``)."""
    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.retrieval.dre_link import DRELink
    env = {"KVREEL_RETRIEVAL": "resv", **({"KVREEL_DRE_ADDRESS": address} if address else {})}
    assert DRELink(KVReelConfig.load(env=env), lambda *a, **k: None).on_this_host is charged
