"""Re-measure README's headline figures on the current code, with one command.

Every results file behind a headline (``report.HEADLINES``) whose figures are
not current (``report.status``: its package paths changed since it was made,
or it is unbacked) or that holds fewer runs than asked is measured again by
the benchmark command that made it, at that benchmark's own settings; each
benchmark runs its configurations round-robin over its runs. Resumable: run it
again after an interruption and it goes on with what is still not current (the
long-context suite also resumes inside a file). ``report.py`` is rerun at the
end, so the tables show what was measured.

    python bench/remeasure.py --tinycode ../shared/models/tinycode-16m-4k
    python bench/remeasure.py ... --dry-run        # what it would run, and why

Each benchmark prints its time when it ends.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import report  # noqa: E402
from common import RESULTS, load_results  # noqa: E402

BENCH = Path(__file__).parent

# the command behind each headline JSON ({tinycode}: the model path given)
COMMANDS: dict[str, list[str]] = {
    "peers": ["peers.py", "--model", "{tinycode}", "--dtype", "float32"],
    "no_reuse": ["peers.py", "--model", "{tinycode}", "--workloads", "no_reuse",
                 "--configs", "vllm,kvreel-host,kvreel-host-step", "--name", "no_reuse"],
    "fleet_warm": ["fleet.py", "--model", "{tinycode}", "--dtype", "float32", "--warm", "--detailed",
                   "--workloads", "prefix_repetition", "--configs", "plain+cache_aware,kvreel+kv_aware",
                   "--name", "fleet_warm"],
    "fleet_failover": ["fleet_failover.py", "--model", "{tinycode}", "--dtype", "float32"],
    "long_context_held_out_32k_yarn8_tinycode-16m-4k_f32": [
        "long_context_suite.py", "--model", "{tinycode}", "--lengths", "32000", "--cases", "0",
        "--configs", "resv:0.125,mosaic:0.125", "--yarn", "8", "--yarn-native", "4096", "--dtype", "float32",
        "--held-out-tokens", "32000", "--runs", "3", "--baseline-anew",
        "--name", "long_context_held_out_32k_yarn8_tinycode-16m-4k_f32"],
    "long_context_held_out_64k_yarn16_tinycode-16m-4k_f32": [
        "long_context_suite.py", "--model", "{tinycode}", "--lengths", "64000", "--cases", "0",
        "--configs", "resv:0.125,mosaic:0.125", "--yarn", "16", "--yarn-native", "4096", "--dtype", "float32",
        "--held-out-tokens", "64000", "--runs", "3", "--baseline-anew",
        "--name", "long_context_held_out_64k_yarn16_tinycode-16m-4k_f32"],
    "long_session": ["long_session.py", "--model", "{tinycode}"],
    "long_session_decode256": ["long_session.py", "--model", "{tinycode}", "--lengths", "4096,65536",
                               "--full-lengths", "1024,4096", "--decode", "256", "--dtype", "float32",
                               "--detokenize", "off", "--name", "long_session_decode256"],
}
TIMED_RUNS = 3          # a timed figure is a median of at least this many runs


def why_stale(name: str) -> str | None:
    """Why ``name``'s figures need measuring again, or None when they are current."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return "no results file"
    d = load_results(name)
    state = report.status(d.get("commit", ""), report.measures(report.script_of(name, d)))
    if state != "current":
        return state
    if d.get("complete") is False:
        return "an interrupted run"
    runs = min((h.take(d).n_runs for h in report.HEADLINES if h.name == name and h.timed), default=TIMED_RUNS)
    return f"{runs} run(s), fewer than {TIMED_RUNS}" if runs < TIMED_RUNS else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tinycode", required=True, help="tinycode-16m-4k's model directory")
    ap.add_argument("--only", default="", help="these results names alone, comma separated")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    names = list(dict.fromkeys(h.name for h in report.HEADLINES))
    missing = [n for n in names if n not in COMMANDS]
    if missing:
        raise SystemExit(f"remeasure: no command for {', '.join(missing)}")
    names = [n for n in names if not a.only or n in a.only.split(",")]
    models = {"tinycode": a.tinycode}
    for name in names:
        reason = why_stale(name)
        if reason is None:
            print(f"== {name}: current")
            continue
        argv = [sys.executable, str(BENCH / COMMANDS[name][0]), *(s.format(**models) for s in COMMANDS[name][1:])]
        print(f"== {name}: {reason}\n   {' '.join(argv[1:])}", flush=True)
        if a.dry_run:
            continue
        t0 = time.monotonic()
        subprocess.run(argv, check=True)
        print(f"== {name}: measured in {(time.monotonic() - t0) / 60:.0f} min", flush=True)
    if not a.dry_run:
        for path in report.write_tables():
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
