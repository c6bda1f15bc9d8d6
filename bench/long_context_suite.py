"""Long sessions that remember: a RULER-style task suite (``long_context_tasks``)
through vLLM with kvreel's retrieval, against full attention in the same run.

Every configuration is one vLLM engine (vllm-cpu, the model's and vLLM's
defaults, prefix caching on as served, prefill in ``--chunk``-token chunks)
that answers every case greedily; a case scores the share of its expected
values found in the answer (RULER's string match), a task the sum over its
cases. Full attention is plain vLLM; the others are vLLM + kvreel with
``KVREEL_RETRIEVAL`` at a budget share of the history
(``KVREEL_RETRIEVAL_BUDGET_SHARE``) and every other setting at its default
unless ``--configs`` says otherwise. The same engine also teacher-forces a
held-out text (the standard library's Python source, none of the prompts),
and the top-1 agreement with full attention at every position past the
retrieval threshold is reported, with the share of the history the working
sets held (kvreel's counters), and the held-out prefill's wall time
(``--cases 0`` runs only the held-out text). ``--runs N`` repeats every
setting N times round-robin: times are medians with every run kept, and each
setting records whether its answers matched its first run's and every run's
score and held-out agreement (which labels the DRE has delivered by a step
moves them). Results are written after every engine; a run of the same commit
and settings that was interrupted goes on where it stopped, and full attention
(plain vLLM, no kvreel code) is kept from a run of any commit with the same
settings, inputs, vLLM version and CPU (its vector ISA and vLLM's attention
kernel), its own commit and machine recorded beside it (``--baseline-anew``:
measured in this run too, as ``bench/remeasure.py`` asks for the timed 32K
headline, so its ratio compares runs of one session). Each run hands its
engines its cases from a folder of its own, so two suites (other names) can
run side by side, each on a core of its own (``VLLM_CPU_OMP_THREADS_BIND=0``
and ``=1``), where only answers are wanted.

    python bench/long_context_suite.py --model models/smollm2-135m

SmolLM2-135M comes from the PyPI GGUF (Q4_1, dequantized to bf16;
``bench/smollm2_model.py``): a caveat for every figure measured on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (CONNECTOR, RESULTS, STARTED_AT, engine_in_subprocess, engine_or_main, machine,  # noqa: E402
                    plot_agreement, python_source_corpus, report, retrieval_counters, save, save_figure, scratch,
                    yarn_overrides)
from long_context_tasks import TASKS, suite  # noqa: E402

MEASURES = ("connector", "scheduler", "dre")  # the package paths its figures measure (bench/report.py)

MIN_TOKENS = 2048           # kvreel's retrieval threshold (its default): agreement is counted past it


def engine_main(args: dict) -> None:
    """One engine: greedy answers to every case, then the held-out text's prompt logprobs."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    work = json.loads(Path(args["work"]).read_text())
    kw = {}
    if args["kvreel"]:
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config={"cpu_bytes": "4GiB"})
    if args.get("yarn"):
        kw["hf_overrides"] = yarn_overrides(args["model"], args["yarn"], args.get("yarn_native", 0))
    llm = LLM(args["model"], enforce_eager=True, max_model_len=args["max_model_len"],
              max_num_batched_tokens=args["chunk"], gpu_memory_utilization=0.05, max_num_seqs=args["batch"],
              seed=0, disable_log_stats=False, dtype=args["dtype"], **kw)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in work["cases"]],
                        SamplingParams(max_tokens=args["max_tokens"], temperature=0.0),
                        use_tqdm=False) if work["cases"] else []
    answers = [o.outputs[0].text for o in outs]
    cases_s = time.perf_counter() - t0
    before = retrieval_counters()
    held_out = work["held_out"]
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=held_out)],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)[0]
    held_out_s = time.perf_counter() - t0
    top1 = [-1] + [max(lp.items(), key=lambda kv: kv[1].logprob)[0] for lp in out.prompt_logprobs[1:]]
    after = retrieval_counters()
    report({"answers": answers, "cases_s": cases_s, "held_out_s": held_out_s, "top1": top1, "metrics": before,
            "held_out_metrics": {k: after.get(k, 0) - before.get(k, 0) for k in after}})
    llm.llm_engine.engine_core.shutdown()


def by_label(counters: dict, name: str) -> dict[str, float]:
    """The counters of ``name`` (``retrieval_counters``' ``name|label`` keys), by label."""
    return {k.split("|")[1]: v for k, v in counters.items() if name in k}


def history_share(m: dict) -> float | None:
    kept = m.get("vllm:kvreel_retrieval_kept_blocks_total", 0)
    history = m.get("vllm:kvreel_retrieval_history_blocks_total", 0)
    return kept / history if history else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="4000,8000", help="prompt lengths in tokens")
    ap.add_argument("--cases", type=int, default=16, help="cases per task and length (needle depths spread evenly)")
    ap.add_argument("--configs", default="resv:0.0625,resv:0.125,resv:0.25,resv:0.5,"
                                         "resv:0.125:CANDIDATES=2,mosaic:0.125:CANDIDATES=2",
                    help="method:budget share[:KVREEL_RETRIEVAL_ settings NAME=VALUE;...], comma separated "
                         "(full attention always runs first)")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens: the prefill chunk")
    ap.add_argument("--batch", type=int, default=4, help="max_num_seqs")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--held-out-tokens", type=int, default=6144)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="the served dtype (vLLM's --dtype): the model's own by default; "
                    "float32 where the CPU lacks fast bf16 (AVX2 only), which also moves near ties")
    ap.add_argument("--runs", type=int, default=1, help="runs of every setting, round-robin: wall times are "
                    "their medians, every run's is kept, and whether answers matched the first run's")
    ap.add_argument("--yarn", type=float, default=0, help="stretch the model's RoPE by YaRN this factor (vLLM's "
                    "hf_overrides), full attention and retrieval alike: 4 takes SmolLM2's 8K to 32K")
    ap.add_argument("--yarn-native", type=int, default=0, help="the context the model was trained on, which YaRN "
                    "stretches (0: its config's max_position_embeddings; tinycode-16m-4k: 4096)")
    ap.add_argument("--baseline-anew", action="store_true", help="measure full attention in this run even where "
                    "an earlier run's could be kept: a timed ratio then compares runs of one session")
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    tasks, lengths = a.tasks.split(","), [int(x) for x in a.lengths.split(",")]
    cases = suite(tok, tasks, lengths, a.cases, a.seed)
    held_out = tok(python_source_corpus(8 * a.held_out_tokens))["input_ids"][:a.held_out_tokens]
    configs = [("full attention", None, {})]
    for spec in filter(None, a.configs.split(",")):
        method, share, *more = spec.split(":")
        extra = dict(kv.split("=", 1) for kv in (more[0].split(";") if more else []))
        env = {"KVREEL_RETRIEVAL": method, "KVREEL_RETRIEVAL_BUDGET_SHARE": share,
               **{f"KVREEL_RETRIEVAL_{k}": v for k, v in extra.items()}}
        configs.append((f"{method} share={share}" + "".join(f" {k}={v}" for k, v in extra.items()), method, env))
    name = a.name or f"long_context_suite_{Path(a.model).name}"
    settings = {k: getattr(a, k) for k in ("tasks", "lengths", "cases", "configs", "chunk", "batch", "max_tokens",
                                           "held_out_tokens", "seed", "dtype", "runs", "yarn",
                                           "yarn_native")}
    inputs_sha256 = hashlib.sha256(json.dumps([[c.prompt_ids for c in cases], held_out]).encode()).hexdigest()
    import vllm
    here = machine()
    results = resumed(name, settings, [c.tokens for c in cases], inputs_sha256, vllm.__version__, here,
                      a.baseline_anew)
    with scratch("kvreel-long-context-suite-") as tmp:
        work = tmp / "cases.json"    # this run's own: a suite run beside it must not hand its engines other cases
        work.write_text(json.dumps({"cases": [c.prompt_ids for c in cases], "held_out": held_out}))
        engine_args = {"model": a.model, "work": str(work), "chunk": a.chunk, "batch": a.batch,
                       "max_tokens": a.max_tokens, "dtype": a.dtype, "yarn": a.yarn, "yarn_native": a.yarn_native,
                       "max_model_len": max(max(lengths), a.held_out_tokens) + a.max_tokens}
        for run in range(a.runs):                # round-robin, so drift on the machine touches every setting alike
            for label, method, env in configs:
                if results.get(label, {}).get("runs", 0) > run:
                    print(f"== {label}, run {run + 1}: kept from commit {results[label]['commit']}", flush=True)
                    continue
                print(f"== {label}, run {run + 1} of {a.runs}", flush=True)
                got = engine_in_subprocess(__file__, {**engine_args, "kvreel": method is not None},
                                           {"VLLM_CPU_KVCACHE_SPACE": "2", **env}, timeout=6 * 3600)
                if "error" in got:
                    raise RuntimeError(f"{label}: {got['error']}")
                summary = summarize(got, cases, tasks, lengths, results.get("full attention", {}).get("top1"),
                                    method, env, held_out)
                if run == 0:
                    results[label] = {**summary, "commit": STARTED_AT, "machine": here, "runs": 1,
                                      "same_as_first_run": True,
                                      "cases_wall_s_runs": [got["cases_s"]],
                                      "held_out_wall_s_runs": [got["held_out_s"]],
                                      "right_total_runs": [summary["right_total"]],
                                      "held_out_top1_agreement_runs": [summary["held_out_top1_agreement"]],
                                      "held_out_top1_agreement_by_position_runs": [
                                          summary["held_out_top1_agreement_by_position"]]}
                else:
                    r = results[label]
                    r["runs"] += 1
                    r["cases_wall_s_runs"].append(got["cases_s"])
                    r["held_out_wall_s_runs"].append(got["held_out_s"])
                    for k in ("right_total", "held_out_top1_agreement",      # the DRE's timing can move them
                              "held_out_top1_agreement_by_position"):
                        if f"{k}_runs" in r:      # absent where run 1 predates them: no list without run 1's value
                            r[f"{k}_runs"].append(summary[k])
                    r["same_as_first_run"] &= all(summary[k] == r[k]
                                                  for k in ("answers", "held_out_top1_agreement", "top1"))
                r = results[label]
                r["cases_wall_s"], r["held_out_wall_s"] = (statistics.median(r["cases_wall_s_runs"]),
                                                           statistics.median(r["held_out_wall_s_runs"]))
                print(json.dumps({k: v for k, v in r.items() if k not in ("per_case", "top1")}), flush=True)
                path = save(name, {"model": Path(a.model).name, "vllm": vllm.__version__, "settings": settings,
                                   "inputs_sha256": inputs_sha256,
                                   "complete": all(results.get(c[0], {}).get("runs", 0) == a.runs for c in configs),
                                   "case_tokens": [c.tokens for c in cases], "results": results})
                print(f"wrote {path}")
                if cases:
                    plot(name, results, tasks, lengths, a.cases, f"{Path(a.model).name} ({a.dtype})")
                plot_held_out(name, results, Path(a.model).name, a.held_out_tokens, a.chunk, a.dtype, a.runs)


def summarize(got: dict, cases: list, tasks: list[str], lengths: list[int], reference: list[int] | None,
              method: str | None, env: dict, held_out: list[int]) -> dict:
    """One engine's answers scored per task and length, its held-out agreement with
    ``reference`` (full attention's top-1 choices; itself for full attention), and
    how often its top-1 choice is the held-out text's next token (whether the model
    is competent at that length at all: a stretched model may not be)."""
    right = [c.score(ans) for c, ans in zip(cases, got["answers"])]
    table = {f"{t}@{n}": round(sum(r for c, r in zip(cases, right) if (c.task, c.length) == (t, n)), 3)
             for t in tasks for n in lengths}
    reference = reference or got["top1"]
    positions = range(MIN_TOKENS, len(reference))
    agree = sum(reference[p] == got["top1"][p] for p in positions) / len(positions) if positions else None

    def by_band(hit) -> dict[str, float]:
        """Share of positions where ``hit(p)``, by position in doublings from MIN_TOKENS:
        where the history is long enough to be narrowed (and prefill chunks select),
        past where it is not."""
        bands, lo = {}, MIN_TOKENS
        while lo < len(reference):
            hi = min(2 * lo, len(reference))
            bands[f"{lo}-{hi}"] = sum(hit(p) for p in range(lo, hi)) / (hi - lo)
            lo = hi
        return bands

    return {"method": method, "env": env, "right": table, "right_total": round(sum(right), 3),
            "cases": len(cases), "per_case": right, "answers": got["answers"],
            "history_share": history_share(got["metrics"]),
            "steps": by_label(got["metrics"], "retrieval_steps"),
            "dre_tables": by_label(got["metrics"], "dre_tables"),
            "scored_tokens": by_label(got["metrics"], "scored_tokens"),
            "held_out_top1_agreement": agree,
            "held_out_top1_agreement_by_position": by_band(lambda p: reference[p] == got["top1"][p]),
            "held_out_next_token_accuracy_by_position": by_band(lambda p: got["top1"][p] == held_out[p]),
            "held_out_history_share": history_share(got["held_out_metrics"]),
            "held_out_scored_tokens": by_label(got["held_out_metrics"], "scored_tokens"),
            "held_out_dre_tables": by_label(got["held_out_metrics"], "dre_tables"),
            "top1": got["top1"] if method is None else None}


def resumed(name: str, settings: dict, case_tokens: list[int], inputs_sha256: str, vllm_version: str,
            here: dict, baseline_anew: bool = False) -> dict:
    """What an earlier run already measured: every configuration where that run was
    interrupted on this commit, else full attention alone (plain vLLM runs no
    kvreel code) where the settings, inputs, vLLM version and CPU are the same
    (vLLM's CPU kernels differ by vector ISA and attention kernel, which can
    move near ties) and ``baseline_anew`` is not asked for."""
    path = RESULTS / f"{name}.json"
    if not path.exists() or "+changes" in STARTED_AT:
        return {}
    old = json.loads(path.read_text())
    # a file from before the inputs' digest was recorded is matched on its cases' token counts
    same_inputs = (old.get("inputs_sha256", inputs_sha256) == inputs_sha256 and old.get("case_tokens") == case_tokens
                   and len(old["results"].get("full attention", {}).get("top1") or []) == settings["held_out_tokens"])
    if old.get("settings") != settings or old.get("vllm") != vllm_version or not same_inputs:
        return {}
    results = {label: {"commit": old["commit"], "machine": old["machine"], **r}
               for label, r in old["results"].items()}
    if old["commit"] != STARTED_AT and baseline_anew:
        return {}
    kept = results if old["commit"] == STARTED_AT else {"full attention": results["full attention"]}
    if any(r["machine"].get(k) != here.get(k) for r in kept.values()
           for k in ("cpu_isa", "bf16_products", "attention_isa")):
        return {}
    return kept


def plot(name: str, results: dict, tasks: list[str], lengths: list[int], cases: int, model: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    width = max(6.4, 3.2 * len(tasks))
    fig, axes = plt.subplots(len(lengths), len(tasks), figsize=(width, 3.0 * len(lengths)), squeeze=False, sharey=True)
    groups: dict[str, list[tuple[float, str]]] = {}
    for label, r in results.items():
        if r["method"]:
            share = float(r["env"]["KVREEL_RETRIEVAL_BUDGET_SHARE"])
            groups.setdefault(label.replace(f" share={r['env']['KVREEL_RETRIEVAL_BUDGET_SHARE']}", ""), []).append(
                (share, label))
    full = results["full attention"]["right"]
    for i, n in enumerate(lengths):
        for j, t in enumerate(tasks):
            ax = axes[i][j]
            key = f"{t}@{n}"
            ax.axhline(full[key], color="black", lw=1, label="full attention")
            ax.axhline(full[key] - cases / 16, color="grey", lw=0.8, ls="--", label="goal: full - 1 case in 16")
            for group, members in groups.items():
                pts = sorted((share, results[label]["right"][key]) for share, label in members)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=group)
            ax.axvline(0.125, color="grey", lw=0.6, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.5, cases + 0.5)
            ax.set_title(f"{t}, {n} tokens", fontsize=8)
            if i == len(lengths) - 1:
                ax.set_xlabel("budget (share of history)", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"score of {cases} cases", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("\n".join(textwrap.wrap(f"RULER-style suite, {model}, vllm-cpu on a 2-core x86 CPU, greedy, "
                                         "one run per setting", int(12 * width))), fontsize=10)
    save_figure(fig, name, dpi=110)


def plot_held_out(name: str, results: dict, model: str, tokens: int, chunk: int, dtype: str, runs: int) -> None:
    """Held-out top-1 agreement against the share of the history read, and the
    held-out prefill's time, one labelled point per configuration, a line per method."""
    full_s = results["full attention"]["held_out_wall_s"]
    shown = [(label, r) for label, r in results.items() if r["method"] and r["held_out_history_share"] is not None]
    plot_agreement(f"{name}_held_out",
                   [(100 * r["held_out_history_share"], 100 * r["held_out_top1_agreement"],
                     f"{label.removeprefix(r['method'] + ' ')}\nprefill {r['held_out_wall_s']:.1f} s")
                    for label, r in shown],
                   "history read (% of the history blocks, every layer)",
                   f"{model} ({dtype}), vllm-cpu on a 2-core x86 CPU: {tokens} held-out tokens of Python teacher-forced in\n"
                   f"{chunk}-token chunks; full attention's prefill {full_s:.0f} s; times: median of {runs} run(s)",
                   [r["method"] for _, r in shown])


if __name__ == "__main__":
    engine_or_main(engine_main, main)
