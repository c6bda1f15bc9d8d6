"""The results tables of README.md and bench/README.md, written from the
committed results (``bench/results/*.json``) between their markers, so that no
figure in either is typed by hand.

Every figure names its JSON, the commit and machine that made it and every
run (median [min-max] where timed). A figure is marked **stale** in the table
itself when the package paths its benchmark measures (each script's
``MEASURES``) changed after the commit that measured it, and **unbacked**
when that commit is not in this checkout's history or had uncommitted changes.

    python bench/report.py            # rewrite both tables
    python bench/report.py --check    # exit 1 if a committed table differs (tests/test_report.py)
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).parent))
from common import PACKAGE_FOLDERS, RESULTS, load_results, machine_words  # noqa: E402

ROOT = Path(__file__).parents[1]
# results written before save() recorded the script (``--name`` chose another name)
OLDER_NAMES = {"no_reuse": "peers", "long_context_held_out": "long_context_suite", "prefill_alpha": "prefill_groups",
               "prefill_budget": "prefill_groups"}


def git(*args: str) -> str | None:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def script_of(name: str, result: dict) -> Path | None:
    """The benchmark script that wrote results ``name``."""
    if result.get("script"):
        return ROOT / "bench" / result["script"]
    scripts = sorted((p.stem for p in (ROOT / "bench").glob("*.py")), key=len, reverse=True)
    for prefix, stem in OLDER_NAMES.items():
        if name.startswith(prefix):
            return ROOT / "bench" / f"{stem}.py"
    stem = next((s for s in scripts if name == s or name.startswith(s + "_")), None)
    return ROOT / "bench" / f"{stem}.py" if stem else None


# Files whose code runs only in a layer-step of retrieval attention: every vLLM process
# with kvreel's plugin imports them, but only KVREEL_RETRIEVAL calls them. A script
# whose ``MEASURES`` name "retrieval off" (it never turns retrieval on) leaves them out.
RETRIEVAL_STEP_ONLY = tuple(f":(exclude)connector/retrieval/{name}.py"
                            for name in ("selection", "cluster_ranking", "scoring", "working_set", "history"))


@functools.cache
def measures(script: Path | None) -> tuple[str, ...]:
    """The package paths a script's figures measure: its ``MEASURES`` (read, not
    imported: the scripts import vLLM; "retrieval off": without
    ``RETRIEVAL_STEP_ONLY``), the whole package where it has none."""
    if script is None or not script.exists():
        return PACKAGE_FOLDERS
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MEASURES" for t in node.targets):
            paths = tuple(ast.literal_eval(node.value))
            if "retrieval off" in paths:
                paths = tuple(p for p in paths if p != "retrieval off") + RETRIEVAL_STEP_ONLY
            return paths
    return PACKAGE_FOLDERS


@functools.cache
def status(commit: str, paths: tuple[str, ...]) -> str:
    """``current``, ``stale: PATHS changed since`` or ``unbacked: ...``. The code is
    compared with this checkout's files, so a change still to be committed counts
    (the table written before a commit is the table after it)."""
    if not commit or commit == "unknown":
        return "unbacked: no commit recorded"
    if commit.endswith("+changes"):
        return "unbacked: measured with uncommitted changes"
    if not paths:
        return "current"
    if git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return "unbacked: commit not in this history"
    excluded = [p for p in paths if p.startswith(":(exclude)")]       # git's pathspec: a file left out
    changed = [p for p in paths if p not in excluded and git("diff", "--quiet", commit, "--", p, *excluded) is None]
    return f"stale: {', '.join(changed)} changed since" if changed else "current"


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """``median [min-max]`` (the value alone for one run)."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def listed(values: list[float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


@dataclass
class Figure:
    figure: str             # the claim, with its medians and ranges
    runs: str               # every run's value
    n_runs: int


@dataclass
class Headline:
    result: str             # what is compared, in a reader's words
    name: str               # bench/results/NAME.json
    take: Callable[[dict], Figure]
    timed: bool = True      # a timing (a median of runs), not a count or a deterministic score
    in_readme: bool = True  # README's table (at most 10 rows); bench/README's holds every headline


def _served(d: dict, workload: str, config: str, field: str = "request_throughput") -> list[float]:
    return [r[field] for r in d["results"][workload][config]["runs"]]


def ratio_of(d: dict, workload: str, ours: str, theirs: str, field: str = "request_throughput",
             unit: str = "req/s", fmt: str = "{:.2f}") -> Figure:
    """Ours against theirs: the ratio of the medians, each median [min-max]."""
    a, b = _served(d, workload, ours, field), _served(d, workload, theirs, field)
    r = statistics.median(a) / statistics.median(b)
    return Figure(f"**{r:.2f}x** ({spread(a, fmt)} vs {spread(b, fmt)} {unit})",
                  f"{listed(a, fmt)} vs {listed(b, fmt)}", min(len(a), len(b)))


def tpot_growth(d: dict) -> Figure:
    """kvreel's decode TPOT at 64K against its own at 4K and against full
    attention's at 64K, or, where that run left 64K out of full attention, at 4K."""
    rows = {r["tokens"]: r for r in d["runs"]["vLLM + kvreel resv (defaults), 128-block cache"]["rows"]}
    full = {r["tokens"]: r for r in d["runs"]["vLLM, cache holds every session (full attention)"]["rows"]}
    a, b = rows[65536]["tpot_ms_each_run"], rows[4096]["tpot_ms_each_run"]
    f = full[65536]["tpot_ms_each_run"] if 65536 in full else None
    m = statistics.median
    if f is None:
        plain = full[4096]["tpot_ms_each_run"]
        per_run = listed([x / y for x, y in zip(a, b)])
        return Figure(f"64K/4K **{m(a) / m(b):.2f}x** ({spread(a)} ms at 64K, {spread(b)} at 4K; "
                      f"{d['settings']['decode']} tokens decoded); at 4K {m(b) / m(plain):.2f}x plain vLLM's "
                      f"{spread(plain)}",
                      f"64K {listed(a)}; 4K {listed(b)}; 64K/4K per run {per_run}; plain 4K {listed(plain)}", len(a))
    return Figure(f"64K/4K **{m(a) / m(b):.2f}x**; vs full attention at 64K **{m(a) / m(f):.2f}x** "
                  f"({spread(a)} ms at 64K, {spread(b)} at 4K, full {spread(f)})",
                  f"64K {listed(a)}; 4K {listed(b)}; full 64K {listed(f)}", len(a))


def held_out_at_length(d: dict) -> Figure:
    """Teacher-forced top-1 agreement with full attention on a long held-out text
    (greedy) and the history each method read, from its first run; a method
    whose later runs chose otherwise (the DRE's labels arrive when they arrive)
    is said to differ."""
    ours = [r for r in d["results"].values() if r["method"]]
    full_accuracy = d["results"]["full attention"].get("held_out_next_token_accuracy_by_position")

    def last_band(r: dict) -> str:
        """The agreement at the longest positions, where the history is narrowed, and
        there the share of the text's next tokens predicted beside full attention's
        (if recorded)."""
        bands = r.get("held_out_top1_agreement_by_position")
        if not bands:
            return ""
        span, agree = list(bands.items())[-1]
        accuracy = r.get("held_out_next_token_accuracy_by_position")
        if not (accuracy and full_accuracy):
            return f" (positions {span}: {100 * agree:.1f} %)"
        return (f" (positions {span}: {100 * agree:.1f} %; next token right there {100 * accuracy[span]:.1f} % "
                f"vs full attention's {100 * full_accuracy[span]:.1f} %)")
    parts = [f"{r['method']} **{100 * r['held_out_top1_agreement']:.1f} %**{last_band(r)}, "
             f"{100 * r['held_out_history_share']:.1f} % of the history per working set" for r in ours]
    runs = min(r.get("runs", 1) for r in ours)
    if runs == 1:
        return Figure("; ".join(parts), "greedy: 1 run", 1)

    def each_run(r: dict) -> str:
        if "held_out_top1_agreement_runs" in r:
            return listed([100 * x for x in r["held_out_top1_agreement_runs"]], "{:.1f}") + " %"
        return "every run the same" if r["same_as_first_run"] else "first run's (later runs differed)"
    said = [f"{r['method']}: {each_run(r)}" for r in ours]
    return Figure("; ".join(parts), f"greedy, {runs} runs; " + "; ".join(said), runs)


def prefill_at_length(d: dict) -> Figure:
    """The held-out text's chunked prefill with retrieval against full attention's
    (plain vLLM, same run): the ratio of the medians, each median [min-max]."""
    m = statistics.median
    full = d["results"]["full attention"]["held_out_wall_s_runs"]
    ours = [(r["method"], r["held_out_wall_s_runs"]) for r in d["results"].values() if r["method"]]
    return Figure("; ".join(f"{name} **{m(a) / m(full):.2f}x**" for name, a in ours) +
                  " (" + ", ".join(f"{name} {spread(a, '{:.0f}')}" for name, a in ours) +
                  f" vs full attention {spread(full, '{:.0f}')} s)",
                  "; ".join(f"{name} {listed(a, '{:.0f}')}" for name, a in ours) + f"; full {listed(full, '{:.0f}')}",
                  min(len(a) for a in [full, *(a for _, a in ours)]))


def failover(d: dict) -> Figure:
    """Every run on the current code: fleet_failover.json and its later sets (one run each)."""
    runs = [d] + [later for _, later in later_sets("fleet_failover", d)]
    total = {k: sum(r[k] for r in runs) for k in ("failed", "requests", "wrong_tokens", "checked_tokens")}
    return Figure(f"{total['failed']} of {total['requests']} requests failed, {total['wrong_tokens']} of "
                  f"{total['checked_tokens']} answer tokens differ from an idle engine's",
                  "wrong tokens " + ", ".join(str(r["wrong_tokens"]) for r in runs), len(runs))


HEADLINES = [
    Headline("vs LMCache (multiprocess, CPU L1), prefix reuse, 4x the paged cache", "peers",
             lambda d: ratio_of(d, "prefix_repetition", "kvreel-host", "lmcache-mem")),
    Headline("vs LMCache, multi-turn chats", "peers",
             lambda d: ratio_of(d, "multi_turn", "kvreel-host", "lmcache-mem"), in_readme=False),
    Headline("vs plain vLLM, prefix reuse, 4x the paged cache", "peers",
             lambda d: ratio_of(d, "prefix_repetition", "kvreel-host", "vllm")),
    Headline("share of the ceiling (plain vLLM whose cache holds everything)", "peers",
             lambda d: ratio_of(d, "prefix_repetition", "kvreel-host", "vllm-ceiling")),
    Headline("cost where nothing is offloaded (both with the ceiling's cache)", "peers",
             lambda d: ratio_of(d, "prefix_repetition", "kvreel-ceiling", "vllm-ceiling"), in_readme=False),
    Headline("cost to a request that reuses nothing: TTFT p50", "no_reuse",
             lambda d: ratio_of(d, "no_reuse", "kvreel-host", "vllm", "ttft_p50_ms", "ms", "{:.0f}")),
    Headline("fleet: 2 engines behind vllm-router, Redis Cluster, warm (kv_aware vs plain cache_aware)",
             "fleet_warm", lambda d: ratio_of(d, "prefix_repetition", "kvreel+kv_aware", "plain+cache_aware")),
    Headline("failover: a Redis Cluster master killed under the fleet's load", "fleet_failover", failover, timed=False),
    Headline("long sessions at 32K (tinycode-16m-4k, float32, stretched by YaRN x8 from the 4K it was trained on): "
             "top-1 agreement with full attention over 32 000 held-out tokens of Python, defaults (1 024 history "
             "tokens a layer-step, 1/32 of 32K)", "long_context_held_out_32k_yarn8_tinycode-16m-4k_f32",
             held_out_at_length, timed=False),
    Headline("long sessions at 32K (tinycode-16m-4k, float32): prefill of the 32 000 held-out tokens with "
             "retrieval vs full attention, s", "long_context_held_out_32k_yarn8_tinycode-16m-4k_f32",
             prefill_at_length),
    Headline("long sessions at 64K (tinycode-16m-4k, float32, stretched by YaRN x16): top-1 agreement with full "
             "attention over 64 000 held-out tokens of Python, defaults (1 024 history tokens a layer-step, 1/64 "
             "of 64K)", "long_context_held_out_64k_yarn16_tinycode-16m-4k_f32", held_out_at_length, timed=False),
    Headline("long sessions at 64K (tinycode-16m-4k, float32): prefill of the 64 000 held-out tokens with "
             "retrieval vs full attention, s", "long_context_held_out_64k_yarn16_tinycode-16m-4k_f32",
             prefill_at_length, in_readme=False),
    Headline("long sessions, decoding: TPOT with retrieval (resv) as the session grows", "long_session", tpot_growth,
             in_readme=False),
    Headline("long sessions, decoding 256 tokens, vLLM's detokenizer off (its cost grows with the prompt): TPOT "
             "with retrieval (resv), 64K against 4K", "long_session_decode256", tpot_growth),
]


def later_sets(name: str, d: dict) -> list[tuple[str, dict]]:
    """Each later set of the same benchmark (``<name>_set<k>.json``): run again
    on the same machine, the package paths it measures unchanged since ``d``'s
    commit (none while ``d`` itself is not current)."""
    paths = measures(script_of(name, d))
    if status(d["commit"], paths) != "current":
        return []
    out = []
    for path in sorted(RESULTS.glob(f"{name}_set*.json")):
        later = json.loads(path.read_text())
        if later["machine"] == d["machine"] and status(later["commit"], paths) == "current":
            out.append((path.name, later))
    return out


def with_later_sets(name: str, d: dict) -> tuple[dict, list[str]]:
    """``d`` with the runs of its later sets appended, so a headline counts every
    run measured on the current code, never the better set alone; and the files
    it read."""
    sets = later_sets(name, d)
    if "results" in d and sets:
        d = copy.deepcopy(d)
        for _, later in sets:
            for workload, configs in later["results"].items():
                for config, result in configs.items():
                    d["results"][workload][config]["runs"] += result["runs"]
    return d, [f"{name}.json", *(n for n, _ in sets)]


def headline_table(readme: bool = False) -> str:
    """The headline figures, one row each: every one (bench/README) or README's."""
    lines = ["| result | figure: median [min-max] | every run | model, machine | JSON, commit | status |",
             "|---|---|---|---|---|---|"]
    for h in (h for h in HEADLINES if h.in_readme or not readme):
        d, files = with_later_sets(h.name, load_results(h.name))
        f = h.take(d)
        state = status(d["commit"], measures(script_of(h.name, d)))
        mark = "" if state == "current" else f"**{state}**"
        lines.append(f"| {h.result} | {f.figure} | {f.runs} | {Path(str(d.get('model'))).name}, "
                     f"{machine_words(d['machine'])} | {', '.join(f'`{n}`' for n in files)}, {d['commit'][:7]} | "
                     f"{mark or 'current'} |")
    return "\n".join(lines)


# held-out runs of long sessions, by length and budget (``long_sessions_table``)
LONG_SESSIONS = ["long_context_held_out_32k_yarn8_tinycode-16m-4k_f32",
                 "long_context_held_out_32k_yarn8_tinycode-16m-4k_f32_budgets",
                 "long_context_held_out_32k_yarn8_tinycode-16m-4k_f32_exact_topk",
                 "long_context_held_out_64k_yarn16_tinycode-16m-4k_f32"]


def long_sessions_table() -> str:
    """Every retrieval setting of ``LONG_SESSIONS``: the history it read, its top-1
    agreement with full attention, and where every prefill chunk selects (the
    longest positions) how often it and full attention predict the text's next token."""
    from kvreel.connector.config import SETTINGS_BY_NAME
    lines = ["| held-out tokens | model, machine | setting | history read per working set | agreement with full "
             "attention: all / where chunks select | next token right where chunks select: setting vs full "
             "attention | runs | JSON, commit | status |", "|---|---|---|---|---|---|---|---|---|"]
    for name in LONG_SESSIONS:
        if not (RESULTS / f"{name}.json").exists():
            continue
        d = load_results(name)
        state = status(d["commit"], measures(script_of(name, d)))
        full_accuracy = d["results"]["full attention"].get("held_out_next_token_accuracy_by_position") or {}
        stretch = f", YaRN x{d['settings']['yarn']:g}" if d["settings"].get("yarn") else ""
        dtype = d["settings"]["dtype"].replace("auto", "its own dtype")
        for label, r in d["results"].items():
            if not r["method"]:
                continue
            span, agree = list(r["held_out_top1_agreement_by_position"].items())[-1]
            accuracy = r.get("held_out_next_token_accuracy_by_position")
            right = (f"{100 * accuracy[span]:.1f} % vs {100 * full_accuracy[span]:.1f} %"
                     if accuracy and span in full_accuracy else "not recorded")
            budget = r["env"].get("KVREEL_RETRIEVAL_BUDGET_TOKENS",
                                  SETTINGS_BY_NAME["RETRIEVAL_BUDGET_TOKENS"].default)
            lines.append(f"| {d['settings']['held_out_tokens']} | {d['model']} ({dtype}{stretch}), "
                         f"{machine_words(r['machine'])} | {label}: at most {budget} history tokens a layer-step | "
                         f"{100 * r['held_out_history_share']:.1f} % | "
                         f"{100 * r['held_out_top1_agreement']:.1f} % / {100 * agree:.1f} % (positions {span}) | "
                         f"{right} | {r.get('runs', 1)} | `{name}.json`, {d['commit'][:7]} | "
                         f"{'current' if state == 'current' else f'**{state}**'} |")
    return "\n".join(lines)


def index_table() -> str:
    """Every committed results file: what wrote it, where, on what, and whether it is current."""
    lines = ["| JSON | script | model | machine | commit, date | runs | status |", "|---|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        script = script_of(path.stem, d)
        runs = (d.get("settings") or {}).get("runs") or (d.get("settings") or {}).get("repeats") or "1"
        lines.append(f"| `{path.name}` | {script.name if script else '?'} | {Path(str(d.get('model'))).name} | "
                     f"{machine_words(d['machine'])} | {d.get('commit', '?')[:7]}, "
                     f"{str(d.get('when', '?'))[:10]} | {runs} | "
                     f"{status(d.get('commit', ''), measures(script))} |")
    return "\n".join(lines)


def settings_table() -> str:
    from kvreel.connector.config import settings_table_markdown
    return settings_table_markdown().rstrip("\n")


def gpu_tests_line() -> str:
    """When the GPU-marked tests last ran and how they went (``gpu_checks.json``'s
    ``gpu_tests``), with that file's status; where it holds no outcomes, when
    the GPU benchmarks last ran."""
    d = load_results("gpu_checks")
    state = status(d["commit"], measures(script_of("gpu_checks", d)))
    where = (f"on {d['machine'].get('gpu', 'a GPU machine')} ({machine_words(d['machine'])}), commit "
             f"{d['commit'][:7]}, {d['when'][:10]}; `bench/results/gpu_checks.json`, "
             f"{'current' if state == 'current' else f'**{state}**'}")
    if "gpu_tests" not in d:
        return (f"GPU tests (`pytest -m gpu tests`): no run's outcomes recorded yet. The GPU benchmarks "
                f"(`bench/gpu_checks.py`) last ran {where}.")
    outcomes = list(d["gpu_tests"]["tests"].values())
    counts = ", ".join(f"{outcomes.count(o)} {o}" for o in ("passed", "failed", "skipped") if o in outcomes)
    return f"GPU tests (`pytest -m gpu tests`, run by `bench/gpu_checks.py`) last ran {where}: {counts or 'none'}."


TABLES = {ROOT / "README.md": {"headline": functools.partial(headline_table, readme=True),
                               "long-sessions": long_sessions_table,
                               "gpu": gpu_tests_line},
          ROOT / "bench" / "README.md": {"headline": headline_table, "index": index_table},
          ROOT / "docs" / "configuration.md": {"settings": settings_table},
          ROOT / "deploy" / "README.md": {"settings": settings_table}}


def rendered(text: str, tables: dict[str, Callable[[], str]]) -> str:
    """``text`` with every ``<!-- report:NAME -->`` ... ``<!-- /report:NAME -->`` block rewritten."""
    for name, make in tables.items():
        start, end = f"<!-- report:{name} -->", f"<!-- /report:{name} -->"
        if start not in text or end not in text:
            raise SystemExit(f"report: no {start} ... {end} markers")
        head, rest = text.split(start, 1)
        text = f"{head}{start}\n{make()}\n{end}{rest.split(end, 1)[1]}"
    return text


def write_tables(check: bool = False) -> list[Path]:
    """The files whose tables differ from the results; rewritten unless ``check``."""
    differ = []
    for path, tables in TABLES.items():
        old = path.read_text()
        new = rendered(old, tables)
        if new != old:
            differ.append(path.relative_to(ROOT))
            if not check:
                path.write_text(new)
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed table differs from the results")
    a = ap.parse_args()
    differ = write_tables(a.check)
    if a.check and differ:
        print(f"out of date: {', '.join(map(str, differ))} (python bench/report.py rewrites them)", file=sys.stderr)
        sys.exit(1)
    for path in differ if not a.check else []:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
