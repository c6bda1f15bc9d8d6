"""TTFT of a request whose long prefix left vLLM's cache: kvreel reload from
the host tier and from the disk tier vs recompute (cold prefill) vs vLLM's own
prefix-cache hit, in one run, for prefixes of 1K-4K tokens.

    python bench/ttft_reload.py --model ../shared/models/tinycode-16m-4k

TTFT here is the wall time of ``LLM.generate`` with ``max_tokens=1`` for one
request (prefill + one sampled token): a round's figure is the median over
``--repeats`` distinct prompts, and the result the median over ``--runs`` rounds
(every engine started anew in each), with every prompt's time in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (CONNECTOR, equal_cpu_split, load_results, machine_words, plot_lines,  # noqa: E402
                    python_source_corpus, save)

MEASURES = ("connector", "scheduler", "retrieval off")  # the package paths its figures measure (bench/report.py)



def make_llm(model, extra, **kw):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra)
    return LLM(model, enforce_eager=True, block_size=32, max_model_len=8192, gpu_memory_utilization=0.05,
               max_num_seqs=4, seed=0, **kw)


def close(llm) -> None:
    """Shut an offline engine down and free its memory before the next one starts."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def ttft(llm, ids) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, out[0].num_cached_tokens


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


RECOMPUTE, PREFIX_HIT = "recompute (cold prefill)", "vLLM prefix-cache hit"
HOST, DISK = "kvreel host-tier reload", "kvreel disk-tier reload"
LABELS = (RECOMPUTE, PREFIX_HIT, HOST, DISK)


def one_round(model: str, lengths: list[int], prompts: dict, warm: list[int]) -> dict:
    """One engine per column: (TTFT, cached tokens) of every prompt, by column and length."""
    out: dict = {label: {} for label in LABELS}
    # plain vLLM: cold prefill and its own prefix-cache hit
    llm = make_llm(model, None)
    ttft(llm, warm)
    for n in lengths:
        out[RECOMPUTE][n] = [ttft(llm, p) for p in prompts[n]]
        out[PREFIX_HIT][n] = [ttft(llm, p) for p in prompts[n]]
    close(llm)

    # kvreel host tier: save on first pass, wipe vLLM's cache, reload
    llm = make_llm(model, {"cpu_bytes": "4GiB"})
    ttft(llm, warm)
    for n in lengths:
        for p in prompts[n]:
            ttft(llm, p)
        out[HOST][n] = []
        for p in prompts[n]:
            llm.reset_prefix_cache()
            out[HOST][n].append(ttft(llm, p))
    close(llm)

    # kvreel disk tier only (host tier off), page cache dropped before each reload when allowed
    with tempfile.TemporaryDirectory() as disk:
        llm = make_llm(model, {"cpu_bytes": "0", "disk_dir": disk})
        ttft(llm, warm)
        dropped = True
        for n in lengths:
            for p in prompts[n]:
                ttft(llm, p)
            time.sleep(0.5)   # let write-behind finish
            out[DISK][n] = []
            for p in prompts[n]:
                llm.reset_prefix_cache()
                dropped &= drop_page_cache()
                out[DISK][n].append(ttft(llm, p))
        close(llm)
    out["dropped"] = dropped
    return out


def plot(out: dict) -> None:
    """TTFT by prefix length per column (median of the rounds, their min-max as a
    band) and the goal line, titled from the JSON's own record."""
    lengths, medians = out["lengths"], out["ttft_ms_round_medians"]
    spreads = {lab: tuple([f(medians[lab][str(n)]) for n in lengths] for f in (min, max)) for lab in medians}
    goal = {"goal: 1.25x vLLM's prefix-cache hit": [1.25 * y for y in out["ttft_ms_median"][PREFIX_HIT]]}
    plot_lines("ttft_reload", lengths, out["ttft_ms_median"], "prefix tokens", "TTFT (ms)",
               f"TTFT after eviction — {out['model']}, vLLM {out['machine']['vllm']}, "
               f"{machine_words(out['machine'])}, block 32, one request at a time; commit {out['commit'][:7]}; "
               f"median of {out['runs']} rounds of {out['repeats']} prompts, band = min-max",
               logy=True, goals=goal, spreads=spreads)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--lengths", default="1024,2048,3072,4096")
    ap.add_argument("--repeats", type=int, default=3, help="prompts per length (distinct prefixes)")
    ap.add_argument("--runs", type=int, default=3, help="rounds, every engine anew; medians over rounds")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from results/ttft_reload.json")
    args = ap.parse_args()
    if args.replot:
        plot(load_results("ttft_reload"))
        return
    if not args.model:
        ap.error("--model is required (or --replot)")
    equal_cpu_split()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    corpus = tok(python_source_corpus(2_000_000))["input_ids"]
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {}
    offset = 0
    for n in lengths:
        prompts[n] = []
        for _ in range(args.repeats):
            prompts[n].append(corpus[offset:offset + n])
            offset += n
    rounds: list[dict] = []          # per round: {label: {length: [(ttft_s, cached tokens) per prompt]}}
    for _ in range(args.runs):       # every engine anew each round, round-robin
        rounds.append(one_round(args.model, lengths, prompts, corpus[-600:]))

    def round_medians(label, n):
        return [statistics.median(t for t, _ in r[label][n]) for r in rounds]

    series = {lab: [statistics.median(round_medians(lab, n)) * 1000 for n in lengths] for lab in LABELS}
    ratios = {n: [h / v for h, v in zip(round_medians(HOST, n), round_medians(PREFIX_HIT, n))] for n in lengths}
    path = save("ttft_reload", {
        "model": Path(args.model).name, "lengths": lengths, "repeats": args.repeats, "runs": args.runs,
        "ttft_ms_median": series,
        "ttft_ms_round_medians": {lab: {str(n): [round(t * 1000, 2) for t in round_medians(lab, n)] for n in lengths}
                                  for lab in LABELS},
        "ttft_ms_per_prompt": [{lab: {str(n): [round(t * 1000, 2) for t, _ in r[lab][n]] for n in lengths}
                                for lab in LABELS} for r in rounds],
        "num_cached_tokens": [{lab: {str(n): [c for _, c in r[lab][n]] for n in lengths} for lab in LABELS}
                              for r in rounds],
        "host_reload_over_prefix_hit": {str(n): {"median": round(statistics.median(r), 3),
                                                 "rounds": [round(x, 3) for x in r]} for n, r in ratios.items()},
        "page_cache_dropped_before_disk_reloads": all(r["dropped"] for r in rounds),
        "goal": "host-tier reload TTFT within 1.25x of vLLM's prefix-cache hit",
    })
    plot(json.loads(path.read_text()))
    for lab, ys in series.items():
        print(f"{lab:32s} " + "  ".join(f"{n}:{y:8.1f}ms" for n, y in zip(lengths, ys)))
    print("host reload / prefix-cache hit:", {n: round(statistics.median(r), 2) for n, r in ratios.items()})
    print("wrote", path)


if __name__ == "__main__":
    main()
