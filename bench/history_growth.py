"""What a decoding step pays to add its block to a long request's history, as the
answer outgrows the room reserved for it (the prompt and a quarter more).

    python bench/history_growth.py [--prompt 8192] [--answer 4096] [--runs 3]

The history goes through the served path, ``RetrievalRuntime.add_history`` for
every layer (pages unpacked, keys and bounds kept), shaped like SmolLM2-135M
(30 layers, 3 KV heads of 64) in float32 with vLLM's default CPU block size
(128); ``KVREEL_RETRIEVAL_NARROWING=pages``, so no DRE takes part. The prompt's
blocks come at once with their room; then the answer's, a block a step:

* ``one layer a step``: as served (told the most the history can reach, layer l
  grows its room when the history is within l / layers of an eighth of it, and
  no room grows past that most);
* baseline in the same run, ``every layer at once``: each layer grows when the
  history outgrows it, as before (so one step copies every layer's history).

Per run, every step's time; the JSON holds each run's, their slowest step and
total, and the medians over runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import plot_lines, save  # noqa: E402

MEASURES = ("connector/retrieval", "dre")  # the package paths its figures measure (bench/report.py)

MODES = {"every layer at once": False, "one layer a step": True}


def runtime(layers: int, heads: int, head_dim: int, block: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.retrieval.runtime import RetrievalRuntime
    rt = RetrievalRuntime(KVReelConfig.load(env={"KVREEL_RETRIEVAL": "resv", "KVREEL_RETRIEVAL_NARROWING": "pages"}))
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=torch.float32)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(1, heads, block, 2 * head_dim) for i in range(layers)}
    rt.register_caches(caches, spec, max_batched_tokens=512)
    return rt


def steps(rt, a, ahead: bool) -> list[float]:
    """Per answer block, the ms its ``add_history`` took."""
    from kvreel.scheduler.history_plan import room_tokens
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(a.prompt // a.block, a.heads, 2 * a.block, a.head_dim, generator=g)
    block = torch.randn(1, a.heads, 2 * a.block, a.head_dim, generator=g)
    room = room_tokens(a.prompt, a.answer) // a.block
    most = (a.prompt + a.answer) // a.block if ahead else 0
    rt.add_history("r", 0, [prompt] * a.layers, room)
    times = []
    for b in range(a.prompt // a.block, (a.prompt + a.answer) // a.block):
        t0 = time.perf_counter()
        rt.add_history("r", b, [block] * a.layers, room, most)
        times.append((time.perf_counter() - t0) * 1000)
    rt.drop("r")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens (its blocks come at once)")
    ap.add_argument("--answer", type=int, default=4096, help="answer tokens (a block a step)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    rt = runtime(a.layers, a.heads, a.head_dim, a.block)
    runs = {mode: [] for mode in MODES}
    for run in tqdm(range(a.runs), desc="runs"):
        order = list(MODES) if run % 2 == 0 else list(reversed(MODES))
        for mode in order:
            runs[mode].append(steps(rt, a, MODES[mode]))
    first = a.prompt // a.block
    x = [(first + i + 1) * a.block for i in range(len(runs[next(iter(MODES))][0]))]
    summary = {mode: {"slowest_step_ms": statistics.median(max(r) for r in rs),
                      "slowest_step_ms_runs": [max(r) for r in rs],
                      "median_step_ms": statistics.median(statistics.median(r) for r in rs),
                      "total_ms": statistics.median(sum(r) for r in rs),
                      "total_ms_runs": [sum(r) for r in rs],
                      "steps_over_10ms_runs": [sum(t > 10 for t in r) for r in rs]}
               for mode, rs in runs.items()}
    settings = {"prompt_tokens": a.prompt, "answer_tokens": a.answer, "layers": a.layers, "kv_heads": a.heads,
                "head_dim": a.head_dim, "block_size": a.block, "dtype": "float32", "runs": a.runs,
                "shape": "SmolLM2-135M's (30 layers, 3 KV heads of 64)", "narrowing": "pages (no DRE)"}
    path = save("history_growth", {"settings": settings, "summary": summary, "history_tokens": x,
                                   "step_ms_runs": runs})
    print(summary, flush=True)
    series = {f"{mode} (median of {a.runs} runs)": [statistics.median(r[i] for r in rs) for i in range(len(x))]
              for mode, rs in runs.items()}
    plot_lines("history_growth", x, series, "history tokens after the step",
               "ms to add the step's block to every layer's history",
               f"decoding past the room reserved for the answer ({a.prompt} prompt tokens, room "
               f"{a.prompt + a.prompt // 4}): SmolLM2-135M shape, float32, block {a.block}, 2-core x86 CPU; "
               f"each point the median of {a.runs} runs", logy=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
