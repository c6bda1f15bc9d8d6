"""Where an engine's memory goes with kvreel's retrieval: resident memory over a
run of long prompts, by part, against plain vLLM in the same run.

    python bench/engine_memory.py --model models/smollm2-135m --dtype float32 --cases 8 [--runs 3]
    python bench/engine_memory.py --replot engine_memory_smollm2-135m

The workload is the long-context suite's (``long_context_tasks``: single
needles at ``--length`` tokens, ``--cases`` of them, ``--batch`` at a time,
prefill chunks of ``--chunk``), as its engines serve it: vLLM's paged cache of
``VLLM_CPU_KVCACHE_SPACE`` GiB, kvreel's host tier at ``--host`` (the suite's
4 GiB) and at a smaller one, retrieval (resv) at its defaults. Each
configuration is a fresh in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so its parts can be read between steps); after every step it records the
process's resident memory and what kvreel holds: the host tier's payloads
(every chunk a prompt computed is saved there, up to its byte budget, for
reuse), the long requests' histories (their KV, keys and cluster labels, and
the room reserved to grow into), the working-set buffers and the steps'
temporaries, and the DRE service's resident memory (its own process).
The paged cache is the size vLLM allocated. What is left is the engine's own
(model, torch, vLLM), which plain vLLM's run shows alone. ``--runs`` rounds
run every configuration once each, round-robin; every run is kept and each part
is reported as its median over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (CONNECTOR, engine_in_subprocess, engine_or_main, load_results, machine_words, report,  # noqa: E402
                    rss_by_process_mib, save, save_figure, summarize_runs)
from long_context_tasks import suite  # noqa: E402

from kvreel.connector.config import parse_bytes  # noqa: E402

MEASURES = ("connector", "scheduler", "dre")  # the package paths its figures measure (bench/report.py)

MIB = 1 << 20
SAMPLES = 200               # kept per run (evenly thinned), besides the peak


def _rss_mib() -> tuple[float, float]:
    """Resident memory (MiB) of this engine process and of its DRE service."""
    rss = rss_by_process_mib(os.getpid())
    return rss["API server"], rss.get("DRE", 0.0)


def engine_main(args: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = {}
    if args["host"]:
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config={"cpu_bytes": args["host"]})
    prompts = json.loads(Path(args["work"]).read_text())
    started = _rss_mib()[0]
    llm = LLM(args["model"], enforce_eager=True, max_model_len=args["max_model_len"], dtype=args["dtype"],
              max_num_batched_tokens=args["chunk"], gpu_memory_utilization=0.05, max_num_seqs=args["batch"], seed=0, **kw)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    paged = sum(t.size for t in core.scheduler.kv_cache_config.kv_cache_tensors)
    loaded = _rss_mib()[0]
    host = runtime = None
    if args["host"]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvreel.connector.retrieval.runtime import RetrievalRuntime
        from kvreel.connector.tiers import Tier
        host = get_kv_transfer_group()._worker.every_tier[Tier.HOST]
        runtime = RetrievalRuntime.built()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(max_tokens=args["max_tokens"], temperature=0.0))
    samples, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        rss, dre = _rss_mib()
        s = {"t": time.perf_counter() - t0, "rss_mib": rss, "dre_mib": dre}
        if host is not None:
            s["host_tier_mib"] = host.nbytes / MIB
        if runtime is not None:
            s.update({f"{k}_mib": v / MIB for k, v in runtime.memory().items()})
        samples.append(s)
    peak = max(samples, key=lambda s: s["rss_mib"] + s["dre_mib"])
    every = max(1, len(samples) // SAMPLES)
    report({"started_mib": started, "loaded_mib": loaded, "paged_cache_mib": paged / MIB,
            "peak": peak, "last": samples[-1], "steps": len(samples),
            "samples": samples[::every], "wall_s": samples[-1]["t"]})
    core.shutdown()


PARTS = (("paged_cache_mib", "vLLM's paged cache"), ("host_tier_mib", "kvreel host tier"),
         ("history_reserved_mib", "retrieval histories (reserved)"), ("working_sets_mib", "working-set buffers"),
         ("temporaries_mib", "step temporaries"), ("dre_mib", "DRE service"))


def breakdown(got: dict) -> dict:
    """The peak's resident memory by part (MiB); ``engine`` is what is left."""
    peak = got["peak"]
    parts = {"paged_cache_mib": got["paged_cache_mib"],
             **{k: peak.get(k, 0.0) for k, _ in PARTS if k != "paged_cache_mib"}}
    parts["engine_mib"] = peak["rss_mib"] + peak["dre_mib"] - sum(parts.values())
    return parts


def peak_total_mib(run: dict) -> float:
    return run["peak"]["rss_mib"] + run["peak"]["dre_mib"]


def summarize(runs: list[dict]) -> dict:
    """A configuration's runs: each part's median and the peak's and end's spread (MiB)."""
    totals = [{"peak_total_mib": peak_total_mib(r), "last_total_mib": r["last"]["rss_mib"] + r["last"]["dre_mib"],
               "wall_s": r["wall_s"]} for r in runs]
    parts = summarize_runs([r["breakdown"] for r in runs])
    return {"breakdown": {k: v["median"] for k, v in parts.items()}, **summarize_runs(totals), "runs": runs}


def plot(out: dict, name: str) -> Path:
    """Left: each configuration's peak by part (medians over the runs), every
    run's peak as a dot, the budget a kvreel engine was given as a dashed line.
    Right: resident memory over every run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, st = out["rows"], out["settings"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 6.2))
    labels = list(rows)
    bottom = [0.0] * len(labels)
    for key, label in (*PARTS, ("engine_mib", "the rest: engine (model, torch, vLLM), and memory freed\n"
                                                "that the allocator kept")):
        ys = [rows[c]["breakdown"][key] / 1024 for c in labels]
        ax.bar(labels, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    budget_label, runs_label = "paged cache + KVREEL_CPU_BYTES", "every run's peak"
    for x, c in enumerate(labels):
        peaks = [peak_total_mib(r) / 1024 for r in rows[c]["runs"]]
        ax.plot([x] * len(peaks), peaks, "k.", ms=5, label=runs_label)
        runs_label = None
        if c.startswith("kvreel"):                     # what the host tier and the histories may take
            top = rows[c]["breakdown"]["paged_cache_mib"] / 1024 + parse_bytes(c.rsplit(" ", 1)[1]) / (1 << 30)
            ax.plot([x - 0.4, x + 0.4], [top, top], "k--", lw=1, label=budget_label)
            budget_label = None
    ax.set_ylabel("GiB at peak (engine process + DRE)")
    ax.set_title(f"resident memory at its peak, by part (medians of {st['runs']} runs)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    for i, c in enumerate(labels):
        for j, run in enumerate(rows[c]["runs"]):
            ax2.plot([s["t"] for s in run["samples"]], [(s["rss_mib"] + s["dre_mib"]) / 1024 for s in run["samples"]],
                     color=f"C{i}", alpha=0.8, lw=1, label=c if j == 0 else None)
    ax2.set_xlabel("seconds since the first request")
    ax2.set_ylabel("GiB resident (engine process + DRE)")
    ax2.set_title(f"resident memory over every run ({st['runs']} per configuration)", fontsize=9)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(f"engine memory, {st['cases']} prompts of {st['length']} tokens, {st['batch']} at a time — "
                 f"{out['model']} {st['dtype']}, paged cache {st['VLLM_CPU_KVCACHE_SPACE']} GiB, vLLM {out['vllm']}; "
                 f"{machine_words(out['machine'])}; commit {out['commit'][:7]}", fontsize=9)
    return save_figure(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--length", type=int, default=8000, help="prompt tokens")
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="max_num_seqs")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--host", default="4GiB,1GiB", help="kvreel host tier sizes (KVREEL_CPU_BYTES), one engine each")
    ap.add_argument("--kvcache-space", default="2", help="VLLM_CPU_KVCACHE_SPACE (GiB), every engine")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--name", default=None)
    ap.add_argument("--runs", type=int, default=3, help="rounds, every configuration once each, round-robin")
    ap.add_argument("--replot", metavar="NAME", help="only redraw results/NAME.png from results/NAME.json")
    a = ap.parse_args()
    if a.replot:
        print(plot(load_results(a.replot), a.replot))
        return
    if not a.model:
        ap.error("--model is required (or --replot)")
    from transformers import AutoTokenizer
    import vllm
    tok = AutoTokenizer.from_pretrained(a.model)
    cases = suite(tok, ["niah_single"], [a.length], a.cases)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kvreel-engine-memory.json"
    work.write_text(json.dumps([c.prompt_ids for c in cases]))
    configs = [("plain vLLM", None)] + [(f"kvreel resv, host {h}", h) for h in a.host.split(",")]
    name = a.name or f"engine_memory_{Path(a.model).name}"
    runs: dict[str, list[dict]] = {label: [] for label, _ in configs}
    for round_ in range(a.runs):          # round-robin, so a slow moment of the machine hits every configuration
        for label, host in configs:
            print(f"== round {round_ + 1}/{a.runs}: {label}", flush=True)
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": a.kvcache_space,
                   **({"KVREEL_RETRIEVAL": "resv"} if host else {})}
            got = engine_in_subprocess(__file__, {"model": a.model, "work": str(work), "host": host, "dtype": a.dtype,
                                                  "chunk": a.chunk, "batch": a.batch, "max_tokens": a.max_tokens,
                                                  "max_model_len": a.length + a.max_tokens + 64}, env,
                                       timeout=3 * 3600)
            if "error" in got:
                raise RuntimeError(f"{label}: {got['error']}")
            got["breakdown"] = breakdown(got)
            runs[label].append(got)
            print(json.dumps({"breakdown": got["breakdown"], "peak_rss_mib": got["peak"]["rss_mib"],
                              "wall_s": got["wall_s"]}), flush=True)
    settings = {"task": "niah_single", "length": a.length, "cases": a.cases, "batch": a.batch, "chunk": a.chunk,
                "max_tokens": a.max_tokens, "host": a.host, "VLLM_CPU_KVCACHE_SPACE": a.kvcache_space,
                "dtype": a.dtype, "retrieval": "resv, defaults", "runs": a.runs,
                "vllm": "in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), equal CPU split"}
    path = save(name, {"model": Path(a.model).name, "vllm": vllm.__version__, "settings": settings,
                       "rows": {label: summarize(rs) for label, rs in runs.items()}})
    print(plot(json.loads(path.read_text()), name))
    for label, rs in runs.items():
        print(f"{label:28s} peak GiB {[round(peak_total_mib(r) / 1024, 2) for r in rs]}")


if __name__ == "__main__":
    engine_or_main(engine_main, main)
