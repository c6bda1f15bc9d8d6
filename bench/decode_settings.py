"""What a decoding step costs under each retrieval setting, on one long session,
against full attention in the same run.

    python bench/decode_settings.py --model ../shared/models/tinycode-16m-4k [--lengths 4096,16384]

Served TPOT compared across engines spreads as widely as the settings differ on
this 2-core machine (``long_session.py``: each engine prefills anew, and its
runs differ by 20 %). Here one engine per length prefills the session once and
then decodes it in segments of ``--segment`` tokens, switching the decoding
setting between segments (round-robin, ``--rounds`` times): every setting
decodes the same history on the same engine, alternately. Settings: the most
history tokens a step reads (``KVREEL_RETRIEVAL_BUDGET_TOKENS`` 1 024, 2 048,
4 096; the share stays 1/8) with ``KVREEL_RETRIEVAL_DECODE_CANDIDATES`` = 2 (the
default: a step scores the tokens of the blocks its queries rank best by their
key bounds and keeps whole blocks, page copies), and
``DECODE_CANDIDATES`` = 0 at 4 096 (tokens chosen as a prefill group chooses
them, written through vLLM's packing). Full attention is plain
vLLM (a cache that holds the session) decoding the same prompt as many tokens
in as many segments. Per segment: TPOT (mean gap between tokens), and for
kvreel the time per step in the working sets (``RetrievalRuntime.working_set``,
the choice and its write) and in the write alone (``WorkingSet.hold`` or
``hold_blocks``). vLLM runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the setting can be switched in the
worker between segments; every engine alike, with the equal CPU split.
With ``--runs N`` every engine of every length runs N times (a new prefill
each), and the JSON holds every run, the median over runs, and per run TPOT at
the longest history over TPOT at the shortest (the flatness goal's ratio).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (CONNECTOR, engine_in_subprocess, engine_or_main, machine, plot_lines,  # noqa: E402
                    python_source_corpus, report, save)

MEASURES = ("connector", "scheduler", "dre")  # the package paths its figures measure (bench/report.py)

# name -> the retrieval settings a segment decodes under (the rest: the defaults)
SETTINGS = {
    "budget <= 1 024 tokens": {"retrieval_budget_tokens": 1024},
    "budget <= 2 048 tokens": {"retrieval_budget_tokens": 2048},
    "budget <= 4 096 tokens": {"retrieval_budget_tokens": 4096},
    "DECODE_CANDIDATES=0": {"retrieval_decode_candidates": 0, "retrieval_budget_tokens": 4096},
}


def _timed(cls, name: str, spent: dict, key: str) -> None:
    """Wraps ``cls.name`` to add its wall time to ``spent[key]`` (instrumentation only)."""
    f = getattr(cls, name)

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t0
    setattr(cls, name, timed)


def engine_main(args: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    kvreel = args["kvreel"]
    spent: dict[str, float] = collections.defaultdict(float)
    kw = {}
    if kvreel:
        from kvreel.connector.retrieval.runtime import RetrievalRuntime
        from kvreel.connector.retrieval.working_set import WorkingSet
        _timed(RetrievalRuntime, "working_set", spent, "working_set")
        for hold in ("hold", "hold_blocks"):
            _timed(WorkingSet, hold, spent, "hold")
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config={"cpu_bytes": "4GiB"})
        kw["num_gpu_blocks_override"] = args["blocks"]
    n = args["tokens"]
    llm = LLM(args["model"], enforce_eager=True, block_size=32, dtype=args["dtype"],
              max_model_len=n + args["decode"] + 64,
              max_num_batched_tokens=args["chunk"], gpu_memory_utilization=0.05, max_num_seqs=4, seed=0,
              hf_overrides={"max_position_embeddings": max(8192, n + args["decode"] + 64)}, **kw)
    engine = llm.llm_engine
    engine.add_request("s", TokensPrompt(prompt_token_ids=json.loads(Path(args["prompt"]).read_text())),
                       SamplingParams(max_tokens=args["decode"] + 1, temperature=0.0, ignore_eos=True))
    names = args["settings"] if kvreel else ["full attention"]
    segments: list[dict] = []
    times: list[float] = []
    current = base = None
    while engine.has_unfinished_requests():
        if times and (len(times) - 1) % args["segment"] == 0 and len(times) - 1 < args["decode"] \
                and (current is None or current["tokens"] > 0):
            name = names[len(segments) % len(names)]
            if kvreel:
                rt = RetrievalRuntime.built()
                base = base or rt.cfg
                rt.cfg = dataclasses.replace(base, **SETTINGS[name])
            spent.clear()
            current = {"setting": name, "start": times[-1], "tokens": 0}
            segments.append(current)
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.outputs and len(o.outputs[0].token_ids) > len(times):
                times.append(now)
                if current is not None:
                    current["tokens"] += 1
                    current["end"] = now
                    current.update({f"{k}_ms_per_step": 1e3 * v / current["tokens"] for k, v in spent.items()})
    for s in segments:
        s["tpot_ms"] = 1e3 * (s.pop("end") - s.pop("start")) / s["tokens"]
    report({"segments": segments})
    engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--segment", type=int, default=64, help="tokens decoded under one setting before the next")
    ap.add_argument("--rounds", type=int, default=3, help="segments of every setting, round-robin")
    ap.add_argument("--blocks", type=int, default=128, help="vLLM's paged cache with kvreel (its history offloaded)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dtype", default="auto",
                    help="the model's dtype in vLLM (float32 where the CPU lacks bf16 products)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma-separated names of SETTINGS to alternate (default: all)")
    ap.add_argument("--runs", type=int, default=1,
                    help="engines per length and configuration (a median over runs, every run kept)")
    ap.add_argument("--name", default="decode_settings")
    a = ap.parse_args()
    chosen = a.settings.split(",")
    if unknown := set(chosen) - set(SETTINGS):
        ap.error(f"unknown settings {sorted(unknown)}; known: {list(SETTINGS)}")
    from transformers import AutoTokenizer
    from kvreel.connector.config import KVReelConfig
    tok = AutoTokenizer.from_pretrained(a.model)
    lengths = [int(x) for x in a.lengths.split(",")]
    corpus = tok(python_source_corpus(8 * max(lengths)))["input_ids"]
    prompt = Path(tempfile.mkdtemp(prefix="kvreel-decode-settings-")) / "prompt.json"
    decode = a.segment * a.rounds * len(chosen)
    # the engine starts with the largest budget: its working-set slots are sized by it at start-up
    largest = max(SETTINGS[c].get("retrieval_budget_tokens", 0) for c in chosen)
    rows = []
    for n in lengths:
        row = {"history_tokens": n}
        prompt.write_text(json.dumps(corpus[:n]))
        runs = collections.defaultdict(list)          # name -> per run: its segments' median and the segments
        for _ in range(a.runs):
            for label, kvreel in (("full attention", False), ("kvreel", True)):
                got = engine_in_subprocess(__file__, {"model": a.model, "tokens": n, "prompt": str(prompt),
                                                      "kvreel": kvreel, "decode": decode, "segment": a.segment,
                                                      "blocks": a.blocks, "chunk": a.chunk, "dtype": a.dtype,
                                                      "settings": chosen},
                                           {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                                            **({"KVREEL_RETRIEVAL": "resv",
                                                "KVREEL_RETRIEVAL_BUDGET_TOKENS": str(largest)} if kvreel else {})},
                                           timeout=3600)
                if "error" in got:
                    raise RuntimeError(f"{label} at {n}: {got['error']}")
                by = collections.defaultdict(list)
                for seg in got["segments"]:
                    by[seg["setting"]].append(seg)
                for name, segs in by.items():
                    run = {"tpot_ms": statistics.median(seg["tpot_ms"] for seg in segs), "segments": segs}
                    for key in ("working_set_ms_per_step", "hold_ms_per_step"):
                        if key in segs[0]:
                            run[key] = statistics.median(seg[key] for seg in segs)
                    runs[name].append(run)
        for name, each in runs.items():
            row[name] = {"tpot_ms": statistics.median(r["tpot_ms"] for r in each),
                         "tpot_ms_each_run": [r["tpot_ms"] for r in each], "runs": each}
        for name in chosen:      # within each run: its engines decoded the same prompt back to back
            ratios = [r["tpot_ms"] / f["tpot_ms"] for r, f in zip(runs[name], runs["full attention"])]
            row[name]["tpot_over_full_attention"] = statistics.median(ratios)
            row[name]["tpot_over_full_attention_each_run"] = ratios
        rows.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "runs"})
                          for k, v in row.items()}), flush=True)
    flatness = {name: {"each_run": [rows[-1][name]["runs"][i]["tpot_ms"] / rows[0][name]["runs"][i]["tpot_ms"]
                                    for i in range(a.runs)]} for name in ("full attention", *chosen)}
    for f in flatness.values():
        f["median"] = statistics.median(f["each_run"])
    settings = {"lengths": a.lengths, "segment": a.segment, "rounds": a.rounds, "blocks": a.blocks, "chunk": a.chunk,
                "block_size": 32, "decoded_per_engine": decode, "retrieval": "resv, defaults but the switched setting",
                "default_budget_tokens": KVReelConfig.load({}).retrieval_budget_tokens,
                "engine_budget_tokens": largest, "dtype": a.dtype, "runs": a.runs,
                "switched": {c: SETTINGS[c] for c in chosen},
                "vllm": "in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), equal CPU split"}
    name = a.name
    path = save(name, {"model": Path(a.model).name, "settings": settings, "rows": rows,
                       "tpot_longest_over_shortest": flatness})
    x = [r["history_tokens"] for r in rows]
    plot_lines(name, x, {k: [r[k]["tpot_ms"] for r in rows] for k in ("full attention", *chosen)},
               "history tokens", f"ms per token (median of {a.runs} runs' segment medians)",
               f"decoding on one session, settings alternated per {a.segment} tokens ({Path(a.model).name} "
               f"{a.dtype}, 2-core x86 CPU, {machine()['cpu_isa']}; {a.runs} runs of {a.rounds} segments each)",
               goals={f"goal: 1.3x {chosen[0]}'s TPOT at {x[0]} tokens": 1.3 * rows[0][chosen[0]]["tpot_ms"]})
    print(f"wrote {path}")


if __name__ == "__main__":
    engine_or_main(engine_main, main)
