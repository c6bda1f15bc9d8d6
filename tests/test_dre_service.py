"""The DRE service in its own process: same answers as in-process ReSV, shared
memory and JSON only, batching, shared-secret auth, death and restart."""

from __future__ import annotations

import socket

import pytest
import torch

from kvreel.connector.retrieval.dre_service import DREClient, DREError, DREProcess, put_tensor, take_tensor
from kvreel.connector.retrieval.resv import cluster_keys, cluster_scores, frame_scores, hyperplanes, wicsum


def data(T=600, D=64, R=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(16, D, generator=g) * 2
    keys = centers[torch.randint(0, 16, (T,), generator=g)] + 0.5 * torch.randn(T, D, generator=g)
    queries = centers[torch.randint(0, 16, (R,), generator=g)] + torch.randn(R, D, generator=g)
    return keys, queries


@pytest.fixture
def dre(tmp_path):
    proc = DREProcess(str(tmp_path / "dre.sock"), bits=12, hamming=1)
    client = proc.start()
    yield proc, client
    client.close()
    proc.stop()


def expected(keys, queries, alpha, per_frame, center=None):
    cl = cluster_keys(keys, hyperplanes(keys.shape[1], 12, seed=1), 1, center)
    s = cluster_scores(queries, cl)
    mask = wicsum(frame_scores(s) if per_frame else s, alpha)
    return cl, mask, cl.tokens(torch.nonzero(mask.any(0)).flatten())


@pytest.mark.parametrize("per_frame", [False, True])
def test_service_answers_exactly_what_resv_computes_in_process(dre, per_frame):
    _, client = dre
    keys, queries = data()
    cl, mask, tokens = expected(keys, queries, 0.9, per_frame)
    assert client.submit("cluster", handle="s0/l3/h1", keys=keys).result(10)["clusters"] == cl.num_clusters
    reply = client.submit("select", handle="s0/l3/h1", queries=queries, alpha=0.9,
                          per_frame=per_frame).result(10)
    assert torch.equal(reply["mask"], mask) and torch.equal(reply["tokens"], tokens)


def test_requests_in_flight_together_are_all_answered(dre):
    _, client = dre
    handles = []
    for i in range(4):
        keys, _ = data(seed=i)
        client.submit("cluster", handle=f"h{i}", keys=keys)
        handles.append((f"h{i}", keys))
    futs = []
    for j in range(20):
        name, keys = handles[j % 4]
        _, queries = data(seed=100 + j)
        futs.append((client.submit("select", handle=name, queries=queries, alpha=0.8), keys, queries))
    for fut, keys, queries in futs:
        assert torch.equal(fut.result(20)["tokens"], expected(keys, queries, 0.8, False)[2])


def test_bad_requests_get_clear_errors_and_do_not_stop_the_service(dre, tmp_path):
    _, client = dre
    _, queries = data()
    with pytest.raises(DREError, match="unknown handle"):
        client.submit("select", handle="nope", queries=queries, alpha=0.5).result(10)
    with pytest.raises(DREError, match="unknown op"):
        client.submit("unpickle").result(10)
    raw = socket.socket(socket.AF_UNIX)            # a peer that sends an oversized header
    raw.connect(str(tmp_path / "dre.sock"))
    raw.sendall((1 << 30).to_bytes(4, "little"))
    raw.close()
    assert client.submit("ping").result(10)["ok"]


def test_shared_secret_is_required_and_checked(tmp_path):
    proc = DREProcess(str(tmp_path / "s.sock"), secret=b"correct horse")
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


def test_a_dead_service_fails_pending_requests_and_is_restarted(dre):
    proc, client = dre
    keys, queries = data()
    client.submit("cluster", handle="h", keys=keys).result(10)
    proc.proc.kill()
    proc.proc.wait()
    with pytest.raises(DREError, match="died|gone|unreachable"):
        client.submit("select", handle="h", queries=queries, alpha=0.9).result(10)
    fresh = proc.ensure(client)
    assert fresh is not client and proc.restarts == 1
    assert fresh.submit("ping").result(10)["ok"]
    with pytest.raises(DREError, match="unknown handle"):     # state is gone: the caller re-clusters
        fresh.submit("select", handle="h", queries=queries, alpha=0.9).result(10)
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
    proc = subprocess.Popen([sys.executable, "-m", "kvreel.connector.cli", "dre",
                             "--address", f":{port}"], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        assert listening_addresses(port) == {"127.0.0.1"}
        client = DREClient(f"127.0.0.1:{port}")
        assert client.submit("ping").result(10)["ok"]
        client.close()
    finally:
        proc.kill()
        proc.wait()


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


def test_pages_of_several_heads_are_kept_by_their_predicted_mass(dre):
    _, client = dre
    (k0, q0), (k1, q1) = data(seed=1), data(seed=2)
    block, alpha = 32, 0.7
    client.submit("cluster", handle="pages", keys=torch.stack([k0, k1])).result(10)
    reply = client.submit("select", handle="pages", queries=torch.stack([q0, q1]), alpha=alpha,
                          per_frame=True, block=block).result(10)
    # in process: each token carries its cluster's frame mass / cluster size; pages sum it over heads
    mass = torch.zeros(len(k0))
    for k, q in ((k0, q0), (k1, q1)):
        cl = cluster_keys(k, hyperplanes(k.shape[1], 12, seed=1), 1)
        cmass = torch.softmax(frame_scores(cluster_scores(q, cl)), -1)[0]
        mass += cmass[cl.labels] / cl.counts[cl.labels]
    pages = torch.zeros(-(-len(k0) // block)).index_add_(0, torch.arange(len(k0)) // block, mass)
    keep = wicsum(pages.log().unsqueeze(0), alpha)[0]
    want = torch.tensor([t for t in range(len(k0)) if keep[t // block]])
    assert torch.equal(reply["tokens"], want)
    assert 0 < len(want) < len(k0)


def test_mosaic_tables_answer_what_the_index_selects_in_process(dre):
    from kvreel.connector.retrieval.mosaic import MosaicSession
    _, client = dre
    keys, queries = data(T=256)
    client.submit("cluster", handle="m", keys=keys, method="mosaic", segment=32).result(30)
    reply = client.submit("select", handle="m", queries=queries, alpha=0.8, per_frame=True).result(30)
    index = MosaicSession.build(keys.float(), 32).index
    mask = index.select_frame(queries, 0.8)
    assert torch.equal(reply["mask"], mask.unsqueeze(0))
    assert torch.equal(reply["tokens"], torch.nonzero(index.token_mask(mask.unsqueeze(0), len(keys))[0]).flatten())
    pages = client.submit("select", handle="m", queries=queries, alpha=0.8, per_frame=True, block=32).result(30)
    kept = pages["tokens"].view(-1, 32)                  # whole 32-token pages, in order
    assert torch.equal(kept, kept[:, :1] + torch.arange(32)) and 0 < len(kept) < len(keys) // 32


def test_extended_tables_answer_as_tables_of_the_whole_history(dre):
    from kvreel.connector.retrieval.mosaic import MosaicSession
    _, client = dre
    keys, queries = data(T=608)
    _, mask, tokens = expected(keys, queries, 0.9, True, center=keys[:320].mean(0))    # centred as first seen
    client.submit("cluster", handle="r0", keys=keys[:320])
    for i, start in enumerate(range(320, 608, 32)):          # a session growing block by block
        client.submit("extend", handle=f"r{i + 1}", base=f"r{i}", keys=keys[start:start + 32])
    reply = client.submit("select", handle="r9", queries=queries, alpha=0.9, per_frame=True).result(10)
    assert torch.equal(reply["mask"], mask) and torch.equal(reply["tokens"], tokens)
    with pytest.raises(DREError, match="unknown handle 'r8'"):          # the base is forgotten
        client.submit("select", handle="r8", queries=queries, alpha=0.9).result(10)
    with pytest.raises(DREError, match="unknown handle 'nope'"):
        client.submit("extend", handle="x", base="nope", keys=keys[:32]).result(10)
    with pytest.raises(DREError, match="keys of 1 heads"):
        client.submit("extend", handle="r10", base="r9", keys=torch.stack([keys[:32], keys[:32]])).result(10)
    assert torch.equal(client.submit("select", handle="r9", queries=queries, alpha=0.9,       # a refused extend
                                     per_frame=True).result(10)["tokens"], tokens)            # keeps its base

    client.submit("cluster", handle="m0", keys=keys[:320], method="mosaic", segment=32)
    client.submit("extend", handle="m1", base="m0", keys=keys[320:])
    reply = client.submit("select", handle="m1", queries=queries, alpha=0.8, per_frame=True).result(30)
    session = MosaicSession.build(keys[:320], 32)
    session.extend(keys[320:])
    want = session.index.select_frame(queries, 0.8)
    assert torch.equal(reply["mask"], want.unsqueeze(0))
    assert torch.equal(reply["tokens"], torch.nonzero(session.index.token_mask(want.unsqueeze(0), 608)[0]).flatten())


def test_a_dre_started_by_a_worker_never_outlives_it(tmp_path):
    import subprocess
    import sys
    import time
    code = ("import sys; from kvreel.connector.retrieval.dre_service import DREProcess\n"
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
