"""The remote tier on a Redis Cluster: six real redis-server nodes on loopback
(3 masters, 3 replicas). A chunk's forms and manifest share one slot, block
pointers spread over the nodes and are read in one pass, a chunk whose slot
moves to another master (resharding) is read throughout, and a killed master
costs bounded failures until its replica is promoted and serves the chunks."""

from __future__ import annotations

import time

import pytest
import redis
import torch

from kvreel.codec.formats import ChunkUnavailable, chunk_key
from kvreel.codec.forms import StoredForms
from kvreel.connector.tiers.remote import RemoteTier
from kvreel.connector.tiers.store import open_store, parse_cluster_url, redact_url
from kvreel.connector.worker_side.fetch.decode_profile import synthetic_payload

SHAPE = torch.Size([3, 4, 4096])
TIMEOUT_S = 1.0


def url(nodes, seeds: int = 2) -> str:
    return "redis-cluster://:s3cret@" + ",".join(f"127.0.0.1:{p}" for p in list(nodes)[:seeds])


def upload(tier: RemoteTier, n: int):
    chunks = []
    for i in range(n):
        payload = synthetic_payload(SHAPE, seed=i)
        hashes = [bytes([i, row]) * 16 for row in range(SHAPE[1])]
        key = chunk_key(hashes)
        assert tier.put(key, hashes, payload)
        chunks.append((key, hashes, payload))
    assert tier.flush(60) and tier.take_failed_writes() == set()
    return chunks


def test_cluster_urls_name_seed_nodes_and_hide_the_password():
    assert parse_cluster_url("redis-cluster://:pw@10.0.0.1:7000,node-b:7001") == ("pw", [("10.0.0.1", 7000),
                                                                                          ("node-b", 7001)])
    assert parse_cluster_url("redis-cluster://[::1]:7000") == (None, [("::1", 7000)])
    for bad in ("redis-cluster://", "redis-cluster://host", "redis-cluster://host:port"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)
    assert redact_url("redis-cluster://:pw@h:1,h:2") == "redis-cluster://:***@h:1,h:2"


def test_chunks_round_trip_with_their_forms_in_one_slot(redis_cluster):
    tier = RemoteTier(url(redis_cluster), StoredForms("model-x", kinds=("raw", "zstd")), TIMEOUT_S, 16)
    try:
        chunks = upload(tier, 12)
        client = tier.store._client
        for key, hashes, payload in chunks:
            for form in ("raw", "zstd"):
                assert torch.equal(tier.get(key, form), payload)
            slots = {client.keyslot(k) for k in (tier.keys.manifest(key), tier.keys.form("raw", key),
                                                 tier.keys.form("zstd", key))}
            assert len(slots) == 1
        pointers = [tier.keys.block(h) for _, hashes, _ in chunks for h in hashes]
        assert len({client.keyslot(k) for k in pointers}) > 3               # spread over the masters
        assert all(v is not None for v in tier.store.get_many(pointers))     # read in one pass all the same
        roles = [n.split()[1] for n in tier.store.nodes()]
        assert sorted(roles) == ["master"] * 3 + ["slave"] * 3
    finally:
        tier.close()


def test_a_killed_master_costs_bounded_misses_then_its_replica_serves(redis_cluster):
    tier = RemoteTier(url(redis_cluster), StoredForms("model-x", kinds=("raw",)), TIMEOUT_S, 16)
    try:
        [(key, _, payload)] = upload(tier, 1)
        master = tier.store._client.get_node_from_key(tier.keys.chunk(key))
        assert redis.Redis(port=master.port, password="s3cret").wait(1, 5000) == 1     # its replica has it
        redis_cluster[master.port].kill()
        redis_cluster[master.port].wait(timeout=10)
        outcomes, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 30:
            started = time.monotonic()
            try:
                served = tier.get(key)
            except ChunkUnavailable as e:                # a miss (recomputed), in bounded time
                assert "remote store" in str(e), e
                outcomes.append(("miss", time.monotonic() - started))
                continue
            assert torch.equal(served, payload)
            outcomes.append(("served", time.monotonic() - started))
            break
        assert outcomes[-1][0] == "served", outcomes
        assert max(dt for _, dt in outcomes) < 10 * TIMEOUT_S, outcomes
        store = open_store(url(redis_cluster), timeout_s=TIMEOUT_S)
        deadline = time.monotonic() + 15           # the node asked may hear of the promotion a gossip round later
        while True:
            roles = [n.split()[1] for n in store.nodes()]
            if (roles.count("master") == 3 and roles.count("master,fail") == 1) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert roles.count("master") == 3 and roles.count("master,fail") == 1, roles    # the replica took over
        store.close()
    finally:
        tier.close()


def test_doctor_shows_the_cluster_nodes_and_their_roles(redis_cluster):
    import os
    import subprocess
    import sys
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")},
           "KVREEL_REMOTE_URL": url(redis_cluster, seeds=1)}
    out = subprocess.run([sys.executable, "-m", "kvreel.cli.main", "doctor"], capture_output=True, text=True,
                         env=env, timeout=120)
    row = next(line for line in out.stdout.splitlines() if line.startswith("remote tier"))
    assert "reachable; cluster nodes:" in row and ":***@" in row and "s3cret" not in out.stdout
    assert row.count(" master") == 3 and row.count(" slave") == 3


def test_a_chunks_slot_moving_between_masters_is_read_throughout(redis_cluster):
    """Resharding as ``redis-cli --cluster reshard`` does it, one step at a time: the
    chunk's slot is marked migrating, its keys move one by one (the client follows
    ASK while they are split over two masters), then the slot is given to the new
    master (MOVED for a client with the old map). Every read is the stored payload,
    and a write after the move lands on the new master."""
    tier = RemoteTier(url(redis_cluster), StoredForms("model-x", kinds=("raw", "zstd")), TIMEOUT_S, 16)
    try:
        [(key, _, payload)] = upload(tier, 1)
        client = tier.store._client
        slot = client.keyslot(tier.keys.chunk(key))
        src_port = client.get_node_from_key(tier.keys.chunk(key)).port
        nodes = {p: redis.Redis(port=p, password="s3cret") for p in redis_cluster}
        roles = {p: r.execute_command("ROLE")[0] for p, r in nodes.items()}
        dst_port = next(p for p, role in roles.items() if role == b"master" and p != src_port)
        src, dst = nodes[src_port], nodes[dst_port]
        src_id, dst_id = src.execute_command("CLUSTER MYID").decode(), dst.execute_command("CLUSTER MYID").decode()
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
        assert len(keys) >= 3                                     # manifest and two forms
        for moved in range(len(keys) + 1):
            for form in ("raw", "zstd"):
                assert torch.equal(tier.get(key, form), payload), (moved, form)
            if moved < len(keys):
                src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "AUTH", "s3cret",
                                    "KEYS", keys[moved])
        assert dst.info("commandstats")["cmdstat_asking"]["calls"] >= 2      # the reads followed ASK
        for r in (nodes[p] for p, role in roles.items() if role == b"master"):
            r.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        assert src.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0
        assert dst.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == len(keys)
        assert torch.equal(tier.get(key, "raw"), payload)        # MOVED: the client learns the new map
        assert client.get_node_from_key(tier.keys.chunk(key)).port == dst_port
        tier.drop_form(key, "zstd")                               # a write goes to the new master too
        assert dst.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == len(keys) - 1
    finally:
        tier.close()
