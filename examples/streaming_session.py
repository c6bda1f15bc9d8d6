"""A streaming session on vLLM with kvreel: "frames" (text segments standing in
for video frames: here, Python source files) are appended turn after turn,
with a question after each; kvreel keeps the session's KV (vLLM's prefix cache
plus kvreel's tiers), and once the session is longer than
KVREEL_RETRIEVAL_MIN_TOKENS each step attends only to the sink, the history
blocks the DRE selects and the local window.

    python examples/streaming_session.py                       # a tiny random model built locally
    python examples/streaming_session.py --model ../shared/models/tinycode-16m-4k --turns 8

Per turn it prints the prompt length, the tokens served from cache, the time,
and the share of history blocks retrieval attention read.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

QUESTIONS = ("# What does the code above define?\n", "# Which function is called most?\n",
             "# Summarise the last file in one line:\n")


def segments(n: int, chars: int) -> list[str]:
    """n frames: consecutive pieces of the standard library's source."""
    from kvreel.cli.tiny_model import corpus_files
    text = "".join(Path(f).read_text(errors="replace") for f in corpus_files()[:40])
    return [text[i * chars:(i + 1) * chars] for i in range(n)]


def counters() -> dict[str, float]:
    from prometheus_client import REGISTRY
    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        for s in metric.samples:
            if s.name.startswith("vllm:kvreel_retrieval") and s.name.endswith("_total"):
                key = s.name + (f"|{s.labels['outcome']}" if "outcome" in s.labels else "")
                out[key] = out.get(key, 0) + s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local model folder (default: build a tiny random Llama)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--frame-chars", type=int, default=1500, help="characters per appended segment")
    ap.add_argument("--retrieval", default="resv", choices=("off", "resv", "mosaic"))
    ap.add_argument("--alpha", default="0.8")
    ap.add_argument("--min-tokens", default="1024")
    ap.add_argument("--window", default="128")
    ap.add_argument("--budget", default="512", help="working-set tokens at most (below the session's history, so "
                                                    "retrieval selects)")
    ap.add_argument("--share", default="0.125", help="working set: at most this share of the history")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", help="also write the per-turn figures here")
    a = ap.parse_args()
    # read by kvreel's vLLM plugin in every engine process: set before vLLM starts
    os.environ.update(KVREEL_RETRIEVAL=a.retrieval, KVREEL_RETRIEVAL_ALPHA=a.alpha,
                      KVREEL_RETRIEVAL_MIN_TOKENS=a.min_tokens, KVREEL_RETRIEVAL_WINDOW=a.window,
                      KVREEL_RETRIEVAL_BUDGET_TOKENS=a.budget, KVREEL_RETRIEVAL_BUDGET_SHARE=a.share)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = a.model
    if model is None:
        from kvreel.cli.tiny_model import build_tiny_llama
        model = str(build_tiny_llama(Path(tempfile.gettempdir()) / "kvreel-tiny-llama"))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=8192, gpu_memory_utilization=0.05,
              disable_log_stats=False, seed=0,
              kv_transfer_config=KVTransferConfig(kv_connector="KVReelConnector", kv_connector_module_path="kvreel.connector",
                                                  kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "256MiB"}))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    session, rows = "", []
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'time':>9} {'history read':>13}  answer")
    for turn, frame in enumerate(segments(a.turns, a.frame_chars)):
        session += frame
        before = counters()
        t0 = time.perf_counter()
        out = llm.generate([session + QUESTIONS[turn % len(QUESTIONS)]], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        after = counters()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        history = delta.get("vllm:kvreel_retrieval_history_blocks_total", 0)
        kept = delta.get("vllm:kvreel_retrieval_kept_blocks_total", 0)
        row = {"turn": turn, "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens or 0,
               "seconds": round(dt, 3), "history_blocks": history, "kept_blocks": kept,
               "retrieval_steps": {k.split("|")[1]: v for k, v in delta.items() if "|" in k and v},
               "answer": out.outputs[0].text}
        rows.append(row)
        share = f"{kept / history:.0%}" if history else "full"
        print(f"{turn:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} {dt * 1000:>7.0f}ms {share:>13}  "
              f"{row['answer'][:40]!r}", flush=True)
        # the answer becomes part of the session, as in a chat
        session += QUESTIONS[turn % len(QUESTIONS)] + out.outputs[0].text + "\n"
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
