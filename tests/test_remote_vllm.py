"""The remote tier inside real vLLM engines, against a real Redis on loopback:
a prefix computed by one engine is reused by a fresh one (async load, request
parked in WAITING_FOR_REMOTE_KVS), exactly; a dead store or a damaged chunk
costs a recompute, never a wrong token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.common import cluster_master
from conftest import run_scenario, tokens

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parents[1]

P = tokens(600, 1)
OTHER = tokens(300, 7)


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Plain vLLM (no kvreel) on P, then P again from its prefix cache: the
    reference every test here compares with, computed once for the module."""
    return run_scenario({"model": tiny_model, "phases": [{"prompts": [P]}, {"prompts": [P]}]})


def _cfg(port):
    # host tier tiny, no disk: after a restart only the remote store holds P
    return {"cpu_bytes": "0", "remote_url": f"redis://:s3cret@127.0.0.1:{port}/0", "remote_timeout_s": 1.0}


@pytest.mark.parametrize("store", ["redis", "redis-cluster", "file"])
def test_prefix_from_another_engine_is_reused_exactly(tiny_model, plain, request, tmp_path, store):
    """On a Redis Cluster a master is then killed: until its replica takes over,
    the chunks it held are recomputed; every output stays exact. P runs alone in
    each phase, as in plain vLLM's: a request parked for its load starts a step
    after others would, and another request decoding beside it moves logprobs'
    last bits in plain vLLM too."""
    phases = [{"prompts": [P]}, {"before": "restart", "prompts": [P]}]
    if store == "redis":
        _, port = request.getfixturevalue("redis_server")
        cfg = _cfg(port)
    elif store == "redis-cluster":
        nodes = request.getfixturevalue("redis_cluster")
        cfg = {**_cfg(0), "remote_url": "redis-cluster://:s3cret@" + ",".join(f"127.0.0.1:{p}" for p in nodes)}
        master = cluster_master(nodes, "s3cret")
        promoted = (f"shell:{sys.executable} -c \"import sys; sys.path.insert(0, '{ROOT}'); "     # the replica took over
                    f"from bench.common import wait_for_failover; wait_for_failover({sorted(nodes)}, {master}, 's3cret')\"")
        phases += [{"before": ["reset_prefix_cache", f"shell:kill -9 {nodes[master].pid}"], "prompts": [P]},
                   {"before": [promoted, "reset_prefix_cache"], "prompts": [P]}]
    else:       # a shared filesystem
        cfg = {**_cfg(0), "remote_url": f"file://{tmp_path / 'shared'}"}
    reel = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": phases})
    assert reel["phases"][0][0] == plain["phases"][0][0]
    again = reel["phases"][1][0]
    assert again["token_ids"] == plain["phases"][1][0]["token_ids"]
    assert again["logprobs"] == plain["phases"][1][0]["logprobs"]
    assert again["num_cached_tokens"] == 576
    for later in reel["phases"][2:]:           # recomputed (a cold prefill) or reused (a prefix hit), exactly
        assert later[0]["logprobs"] in (plain["phases"][0][0]["logprobs"], plain["phases"][1][0]["logprobs"])
    if store == "redis-cluster":
        assert reel["phases"][3][0]["num_cached_tokens"] == 576              # the replica serves them again
    hits = reel["metrics"]["vllm:kvreel_lookup_hit_blocks_total|remote"]
    assert hits >= 36 if store == "redis-cluster" else hits == 18


def test_dead_store_falls_back_to_recompute(tiny_model, plain, redis_server):
    proc, port = redis_server
    reel = run_scenario({"model": tiny_model, "kvreel": _cfg(port), "phases": [
        {"prompts": [P]}, {"before": "restart", "prompts": [OTHER]},
        {"before": f"shell:kill -9 {proc.pid}", "prompts": [P]}]})
    assert reel["phases"][2][0] == plain["phases"][0][0]
    assert "remote lookup failed" in reel["log"]


def test_damaged_remote_chunk_is_recomputed(tiny_model, plain, redis_server):
    """Only the raw form is stored, so the damaged chunk has no intact form to fall back to."""
    _, port = redis_server
    corrupt = ("shell:" + sys.executable + " -c \"import redis; r=redis.Redis(port=" + str(port) +
               ", password='s3cret')\nfor k in r.scan_iter('kvreel/*/c/*'):\n"
               "    n=r.strlen(k); r.setrange(k, n-100, bytes([r.getrange(k,n-100,n-100)[0]^255]))\"")
    reel = run_scenario({"model": tiny_model, "kvreel": {**_cfg(port), "remote_forms": "raw"}, "phases": [
        {"prompts": [P]}, {"before": "restart", "prompts": [OTHER]},
        {"before": corrupt, "prompts": [P]}]})
    after = reel["phases"][2][0]
    assert after["token_ids"] == plain["phases"][0][0]["token_ids"]
    assert after["logprobs"] == plain["phases"][0][0]["logprobs"]
    assert reel["metrics"]["vllm:kvreel_corrupt_chunks_total|remote"] >= 1
    assert "payload checksum mismatch" in reel["log"]


@pytest.mark.parametrize("form,mode", [("zstd", "async"), ("video@256", "async"), ("raw", "blocking")])
def test_every_stored_form_restores_exactly(tiny_model, plain, redis_server, form, mode):
    """Chunks stored raw + zstd + lossless video; the second engine fetches them in
    one fixed form (KVREEL_FETCH_FORM), parked or inside the forward pass
    (KVREEL_FETCH_MODE), and gets bit-identical outputs."""
    _, port = redis_server
    cfg = {**_cfg(port), "remote_forms": "raw,zstd,video", "remote_resolutions": "256", "fetch_form": form,
           "fetch_mode": mode}
    reel = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": [
        {"prompts": [P]}, {"before": "restart", "prompts": [P]}]})
    again = reel["phases"][1][0]
    assert again["num_cached_tokens"] == 576
    assert again["token_ids"] == plain["phases"][1][0]["token_ids"]
    assert again["logprobs"] == plain["phases"][1][0]["logprobs"]
    fetched = {k: v for k, v in reel["metrics"].items() if k.startswith("vllm:kvreel_remote_fetches_total")}
    assert fetched == {f"vllm:kvreel_remote_fetches_total|{form}": 3}
    assert reel["metrics"][f"vllm:kvreel_remote_transfer_seconds_total|{form}"] > 0
    assert reel["metrics"][f"vllm:kvreel_decode_seconds_total|{form}"] > 0


def test_damaged_video_form_falls_back_to_raw_exactly(tiny_model, plain, redis_server):
    _, port = redis_server
    cfg = {**_cfg(port), "remote_forms": "raw,video", "remote_resolutions": "256", "fetch_form": "video@256"}
    corrupt = ("shell:" + sys.executable + " -c \"import redis; r=redis.Redis(port=" + str(port) +
               ", password='s3cret')\nfor k in r.scan_iter('kvreel/*/video256/*'):\n"
               "    n=r.strlen(k); r.setrange(k, n-50, bytes([r.getrange(k,n-50,n-50)[0]^255]))\"")
    reel = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": [
        {"prompts": [P]}, {"before": "restart", "prompts": [OTHER]}, {"before": corrupt, "prompts": [P]}]})
    again = reel["phases"][2][0]
    assert again["num_cached_tokens"] == 576
    assert again["token_ids"] == plain["phases"][1][0]["token_ids"]
    assert again["logprobs"] == plain["phases"][1][0]["logprobs"]
    assert reel["metrics"]["vllm:kvreel_remote_fetches_total|raw"] == 3
    assert "video@256 form of remote chunk" in reel["log"]


def test_a_chunk_cut_short_by_another_engine_never_replaces_it(tiny_model, plain, tmp_path):
    """Two engines share a store. The first computed P whole (its first chunk:
    blocks 0-7). The second's own prefix cache held blocks 0-1 of P, so it
    computed and stored blocks 2-7 as a chunk of their own, and its uploads came
    last (here: its store, with the first engine's objects merged in without
    overwriting). A third engine loads P through both engines' block pointers:
    every block must bring its own KV (when a chunk's key was its last block's
    hash, both chunks had one key and blocks 0-1 got the KV of blocks 2-3)."""
    shared, aside = tmp_path / "shared", tmp_path / "first-engine"
    merge = (f"shell:{sys.executable} -c \"import shutil, os; shutil.copytree('{aside}', '{shared}', "
             "dirs_exist_ok=True, copy_function=lambda s, d: os.path.exists(d) or shutil.copy2(s, d))\"")
    reel = run_scenario({"model": tiny_model, "kvreel": {**_cfg(0), "remote_url": f"file://{shared}"}, "phases": [
        {"prompts": [P]},
        {"before": "restart", "prompts": [P[:2 * 32 + 5]]},           # blocks 0-1 into vLLM's cache (from the store)
        {"before": f"shell:mv {shared} {aside}", "prompts": [P]},    # the store misses: blocks 2-17 computed
        {"before": ["restart", merge], "prompts": [P]}]})
    assert reel["phases"][2][0]["num_cached_tokens"] == 64
    again = reel["phases"][3][0]
    assert again["num_cached_tokens"] == 576
    assert again["token_ids"] == plain["phases"][1][0]["token_ids"]
    assert again["logprobs"] == plain["phases"][1][0]["logprobs"]
