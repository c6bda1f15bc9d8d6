"""TTFT of a request whose long prefix left vLLM's cache: kvreel reload from
the host tier and from the disk tier vs recompute (cold prefill) vs vLLM's own
prefix-cache hit, in one run, for prefixes of 1K-4K tokens.

    python bench/ttft_reload.py --model ../shared/models/tinycode-16m-4k

TTFT here is the wall time of ``LLM.generate`` with ``max_tokens=1`` for one
request (prefill + one sampled token), median over ``--repeats`` distinct prompts.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import CONNECTOR, equal_cpu_split, machine, plot_lines, python_source_corpus, save  # noqa: E402



def make_llm(model, extra, **kw):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra)
    return LLM(model, enforce_eager=True, block_size=32, max_model_len=8192, gpu_memory_utilization=0.05,
               max_num_seqs=4, seed=0, **kw)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="1024,2048,3072,4096")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
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
    results = {n: {} for n in lengths}
    runs = {n: {} for n in lengths}
    cached = {n: {} for n in lengths}

    def record(n, label, pairs):
        results[n][label] = statistics.median(t for t, _ in pairs)
        runs[n][label] = [round(t * 1000, 2) for t, _ in pairs]
        cached[n][label] = [c for _, c in pairs]

    # plain vLLM: cold prefill and its own prefix-cache hit
    llm = make_llm(args.model, None)
    ttft(llm, corpus[-600:])  # warm-up
    for n in lengths:
        record(n, "recompute (cold prefill)", [ttft(llm, p) for p in prompts[n]])
        record(n, "vLLM prefix-cache hit", [ttft(llm, p) for p in prompts[n]])
    llm.llm_engine.engine_core.shutdown(); del llm; gc.collect()

    # kvreel host tier: save on first pass, wipe vLLM's cache, reload
    llm = make_llm(args.model, {"cpu_bytes": "4GiB"})
    ttft(llm, corpus[-600:])
    for n in lengths:
        for p in prompts[n]:
            ttft(llm, p)
        pairs = []
        for p in prompts[n]:
            llm.reset_prefix_cache()
            pairs.append(ttft(llm, p))
        record(n, "kvreel host-tier reload", pairs)
    llm.llm_engine.engine_core.shutdown(); del llm; gc.collect()

    # kvreel disk tier only (host tier off), page cache dropped before each reload when allowed
    with tempfile.TemporaryDirectory() as disk:
        llm = make_llm(args.model, {"cpu_bytes": "0", "disk_dir": disk})
        ttft(llm, corpus[-600:])
        dropped = True
        for n in lengths:
            for p in prompts[n]:
                ttft(llm, p)
            time.sleep(0.5)   # let write-behind finish
            pairs = []
            for p in prompts[n]:
                llm.reset_prefix_cache()
                dropped &= drop_page_cache()
                pairs.append(ttft(llm, p))
            record(n, "kvreel disk-tier reload", pairs)
        llm.llm_engine.engine_core.shutdown(); del llm; gc.collect()

    labels = list(results[lengths[0]])
    series = {lab: [results[n][lab] * 1000 for n in lengths] for lab in labels}
    ratio = {n: results[n]["kvreel host-tier reload"] / results[n]["vLLM prefix-cache hit"] for n in lengths}
    path = save("ttft_reload", {
        "model": Path(args.model).name, "lengths": lengths, "repeats": args.repeats, "ttft_ms_median": series,
        "ttft_ms_per_prompt": {str(n): runs[n] for n in lengths},
        "num_cached_tokens": {str(n): cached[n] for n in lengths},
        "host_reload_over_prefix_hit": {str(n): round(r, 3) for n, r in ratio.items()},
        "page_cache_dropped_before_disk_reloads": dropped,
        "goal": "host-tier reload TTFT within 1.25x of vLLM's prefix-cache hit",
    })
    host = machine()
    goal = {"goal: 1.25x vLLM's prefix-cache hit": [1.25 * y for y in series["vLLM prefix-cache hit"]]}
    plot_lines("ttft_reload", lengths, {**series, **goal}, "prefix tokens", f"TTFT (ms, median of {args.repeats} prompts)",
               f"TTFT after eviction — {Path(args.model).name}, vLLM {host['vllm']}, {host['cpus']}-core CPU", logy=True)
    for lab, ys in series.items():
        print(f"{lab:32s} " + "  ".join(f"{n}:{y:8.1f}ms" for n, y in zip(lengths, ys)))
    print("host reload / prefix-cache hit:", {n: round(r, 2) for n, r in ratio.items()})
    print("wrote", path)


if __name__ == "__main__":
    main()
