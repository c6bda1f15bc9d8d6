"""A fleet of two vLLM engines behind vllm-router, measured with vLLM's own client.

    python bench/fleet.py --model ../shared/models/tinycode-16m-4k [--runs 3]

Each configuration is two vLLM OpenAI servers on loopback, one CPU core each
(``taskset``), their paged caches held to ``--kv-blocks`` blocks (the working
set is several times one engine's cache), behind ``vllm-router`` (PyPI 0.1.17)
with one of its policies, and ``vllm bench serve`` sends the workload to the
router:

* ``plain+round_robin``, ``plain+cache_aware`` (the router's approximate prefix
  tree), ``plain+kv_aware`` (vLLM's own KV events): vLLM without kvreel;
* ``kvreel+round_robin``, ``kvreel+kv_aware``: kvreel in both engines (host tier
  ``--host-bytes`` each, a shared 3-master Redis Cluster as the remote tier),
  kvreel's tiers in the KV events for ``kv_aware``.

Workloads (as in ``bench/peers.py``): ``prefix_repetition`` (vLLM's dataset) and
multi-turn conversations (each turn resends the history). Every (configuration,
workload) gets a fresh fleet; runs go round-robin over the configurations, so a
slow spell of the machine hits all of them. Reported: every run's figures and
their median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (cluster_master, commit, engine_env, free_port, save, save_figure, scratch,  # noqa: E402
                    start_redis_cluster, stop_all, zmq_relay)
from peers import (add_dtype_arg, add_workload_args, bench_serve, build_workloads, engine_args, plot_rounds,  # noqa: E402
                   prefix_counters, run_rounds, workload_settings)

from kvreel.cli.serve import CONNECTOR_JSON  # noqa: E402
from kvreel.cli.server_process import stop_server, wait_healthy  # noqa: E402
from kvreel.connector.config import format_bytes, parse_bytes  # noqa: E402

MEASURES = ("connector", "scheduler", "codec", "retrieval off")  # the package paths its figures measure (bench/report.py)

CONFIGS = {"plain+round_robin": (False, "round_robin"), "plain+cache_aware": (False, "cache_aware"),
           "plain+kv_aware": (False, "kv_aware"), "kvreel+round_robin": (True, "round_robin"),
           "kvreel+kv_aware": (True, "kv_aware")}
BLOCK = 32


class Fleet:
    """Two engines (one core each), the store for kvreel, the router: started, then stopped."""

    def __init__(self, kvreel: bool, policy: str, a, work: Path, replicas: int = 0):
        self.replicas = replicas
        self.procs: list[subprocess.Popen] = []
        self.cluster: dict = {}
        self.engines: list[str] = []
        try:
            self._start(kvreel, policy, a, work)
        except BaseException:
            self.stop()
            raise

    def _start(self, kvreel: bool, policy: str, a, work: Path) -> None:
        env = engine_env({"PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
        env = {k: v for k, v in env.items() if not k.startswith("KVREEL_")}
        if kvreel:
            self.cluster = start_redis_cluster(work / "cluster", masters=3, replicas=self.replicas)
            env.update(KVREEL_CPU_BYTES=str(a.host_bytes), KVREEL_REMOTE_URL="redis-cluster://" + ",".join(
                f"127.0.0.1:{p}" for p in self.cluster))
        sources = []
        for i in range(2):
            port = free_port()
            args = ["--model", a.model, "--host", "127.0.0.1", "--port", str(port),
                    *engine_args(a.kv_blocks, a.max_model_len, a.dtype)]
            if kvreel:
                args += ["--kv-transfer-config", CONNECTOR_JSON]
            base = f"http://127.0.0.1:{port}"
            if policy == "kv_aware":
                publish, subscribe = zmq_relay()
                args += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                           "endpoint": publish})]
                sources += ["--kv-event-source", f"{base}={subscribe}"]
            cmd = ["taskset", "-c", str(i % os.cpu_count()), sys.executable, "-m",
                   "vllm.entrypoints.openai.api_server", *args]
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=(work / f"engine{i}.log").open("w"),
                                               stderr=subprocess.STDOUT, start_new_session=True))
            self.engines.append(base)
        for proc, base in zip(self.procs, self.engines):
            failed = wait_healthy(proc, base)
            if failed:
                raise RuntimeError(f"{failed}; see {work}")
        port = free_port()
        cmd = [shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or "vllm-router",
               "--policy", policy, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *self.engines]
        if policy == "kv_aware":
            cmd += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", a.model, *sources]
        self.procs.append(subprocess.Popen(cmd, stdout=(work / "router.log").open("w"), stderr=subprocess.STDOUT,
                                           start_new_session=True))
        self.router = f"http://127.0.0.1:{port}"
        failed = wait_healthy(self.procs[-1], self.router, timeout_s=60)
        if failed:
            raise RuntimeError(f"the router: {failed}; see {work / 'router.log'}")

    def kill_master(self) -> int:
        """SIGKILL one of the cluster's masters; its port."""
        port = cluster_master(self.cluster)
        self.cluster[port].kill()
        return port

    def counters(self) -> dict[str, float]:
        """vLLM's prefix-cache counters (its own and its connector's), summed over the engines."""
        out: dict[str, float] = {}
        for base in self.engines:
            for k, v in prefix_counters(base).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_server(proc)
        stop_all(self.cluster.values())


def warm_prompts(a) -> list[str]:
    """``prefix_repetition``'s prefixes, each once, with a suffix of its own: what a
    fleet that served these prefixes before the measured requests has seen.
    Each prefix's text is its first request's prompt cut after ``--prefix-len``
    tokens (the dataset keeps its prefix tokens to itself)."""
    import numpy as np
    tok, reqs = client_requests(a)
    rng = np.random.default_rng(1)
    return [tok.decode(ids[:a.prefix_len]) + tok.decode(rng.integers(0, tok.vocab_size, a.suffix_len).tolist())
            for _, ids, first in reqs if first]


def send_completions(base: str, model: str, prompts: list[str], concurrency: int = 4) -> None:
    """Each prompt through ``base``'s ``/v1/completions``, one token each, at most ``concurrency`` in flight."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str) -> None:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))


def run_once(name: str, workload: list[str], a, work: Path, warm: list[str] | None = None) -> dict:
    """One fleet, one run of ``workload``; ``warm`` prompts are served first and not measured."""
    kvreel, policy = CONFIGS[name]
    fleet = Fleet(kvreel, policy, a, work)
    try:
        if warm:
            send_completions(fleet.router, a.model, warm)
        before = fleet.counters()
        got = bench_serve(fleet.router, a.model, workload, work / "result.json", work / "client.log", served=a.model,
                          detailed=a.detailed)
        d = {k: v - before.get(k, 0.0) for k, v in fleet.counters().items()}
    finally:
        fleet.stop()
    queried = d.get("vllm:prefix_cache_queries_total", 0.0)
    per_request = {"ttfts_ms": [1e3 * t for t in got["ttfts"]], "input_lens": got["input_lens"]} if a.detailed else {}
    return {**per_request, "completed": got["completed"], "failed": got.get("failed", 0), "duration_s": got["duration"],
            "request_throughput": got["request_throughput"], "total_token_throughput": got["total_token_throughput"],
            "ttft_p50_ms": got["median_ttft_ms"], "ttft_p99_ms": got["p99_ttft_ms"],
            "tpot_p50_ms": got["median_tpot_ms"],
            "hit_rate_vllm_prefix_cache": d.get("vllm:prefix_cache_hits_total", 0.0) / queried if queried else 0.0,
            "hit_rate_kvreel": d.get("vllm:external_prefix_cache_hits_total", 0.0) / queried if queried else 0.0}


def client_requests(a) -> tuple:
    """``prefix_repetition``'s requests in the order ``vllm bench serve`` sends them
    (its dataset drawn again with the same seed and tokenizer): the tokenizer, and
    per request its prompt, the prompt's token ids and whether it is the first to
    carry its prefix (requests share a prefix where their first half-prefix of
    tokens is equal)."""
    from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer
    tok = get_tokenizer(a.model)
    drawn = PrefixRepetitionRandomDataset(random_seed=0).sample(
        tok, num_requests=a.num_prompts, prefix_len=a.prefix_len, suffix_len=a.suffix_len,
        num_prefixes=a.prefixes, output_len=a.output_len)
    seen: set[tuple[int, ...]] = set()
    reqs = []
    for r in drawn:
        ids = tok.encode(r.prompt, add_special_tokens=False)
        prefix = tuple(ids[:a.prefix_len // 2])
        reqs.append((r.prompt, ids, prefix not in seen))
        seen.add(prefix)
    return tok, reqs


def first_uses(a) -> tuple[list[bool], list[int]]:
    """For ``prefix_repetition``'s requests in the order the client sends them:
    whether each is the first to carry its prefix (no engine can hold that prefix
    yet), and each one's prompt length as the client reports it (the prompt's
    text encoded again: to check the order against the client's)."""
    tok, reqs = client_requests(a)
    return [first for _, _, first in reqs], [len(tok.encode(prompt)) for prompt, _, _ in reqs]


def ttft_by_use(by: dict, first: list[bool], lens: list[int]) -> dict:
    """Per configuration and run: TTFT of the requests that first carry a prefix
    (median, max) and of the others (median, p99), beside the run's p99."""
    import numpy as np
    out = {}
    for c, v in by.items():
        rows = []
        for run in v["runs"]:
            t = np.array(run["ttfts_ms"])
            cold = np.array(first)
            rows.append({"order_matches_client": run["input_lens"] == lens, "first_uses": int(cold.sum()),
                         "first_use_median_ms": float(np.median(t[cold])), "first_use_max_ms": float(t[cold].max()),
                         "reuse_median_ms": float(np.median(t[~cold])),
                         "reuse_p99_ms": float(np.percentile(t[~cold], 99)), "all_p99_ms": float(np.percentile(t, 99)),
                         "slowest_requests_first_uses": int(cold[np.argsort(t)[-len(t) // 20:]].sum())})
        out[c] = {"runs": rows, **{k: float(np.median([r[k] for r in rows])) for k in rows[0]
                                   if k.endswith("_ms")}}
    return out


def plot_ttft_by_use(name: str, saved: dict) -> None:
    """Every request's TTFT on ``prefix_repetition``, per configuration and run,
    the first uses of a prefix marked apart from the reuses."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by = saved["results"]["prefix_repetition"]
    first = saved["first_uses"]
    warm = bool(saved["settings"].get("warm"))
    first_label = "first measured use (served once before)" if warm else "first use of a prefix"
    fig, ax = plt.subplots(figsize=(9, 4.4))
    for x, (c, v) in enumerate(by.items()):
        for r, run in enumerate(v["runs"]):
            at = x + (r - 1) * 0.22
            firsts = [t for t, f in zip(run["ttfts_ms"], first) if f]
            reuses = [t for t, f in zip(run["ttfts_ms"], first) if not f]
            ax.plot([at] * len(reuses), reuses, ".", color="tab:blue", alpha=0.5, label="reuse" if x == r == 0 else None)
            ax.plot([at] * len(firsts), firsts, "x", color="tab:red", label=first_label if x == r == 0 else None)
            p99 = saved["ttft_by_use"][c]["runs"][r]["all_p99_ms"]
            ax.plot([at - 0.09, at + 0.09], [p99, p99], "k-", lw=1.5, label="run's p99" if x == r == 0 else None)
    ax.set_xticks(range(len(by)), list(by), fontsize=8)
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    s = saved["settings"]
    ax.set_title(f"prefix_repetition{', warm fleet' if warm else ''}, every request of every run (runs side by "
                 f"side):\n{saved['model']} "
                 f"({s.get('dtype', 'auto')}), two engines, 1 {saved['machine'].get('cpu_isa', 'x86')} core each",
                 fontsize=9)
    save_figure(fig, name + "_ttft_by_use")


def plot_fleet(name: str, saved: dict) -> None:
    """The fleet's plot from its saved JSON, with the issue's goals against plain
    vLLM + cache_aware: kvreel + kv_aware at 1.5x its throughput and below its p99 TTFT."""
    goals = {}
    for w, by in saved["results"].items():
        if "plain+cache_aware" in by:
            base = by["plain+cache_aware"]["median"]
            goals[(w, "request_throughput")] = (1.5 * base["request_throughput"]["median"],
                                                "goal (kvreel+kv_aware): 1.5x plain+cache_aware")
            goals[(w, "ttft_p99_ms")] = (base["ttft_p99_ms"]["median"], "goal (kvreel+kv_aware): below plain+cache_aware")
    s = saved["settings"]
    warm = ", warm fleet" if s.get("warm") else ""
    plot_rounds(name, saved["results"], f"two engines behind vllm-router{warm} — {saved['model']} ({s.get('dtype', 'auto')}), "
                f"vllm-cpu, 1 {saved['machine'].get('cpu_isa', 'x86')} core per engine, {s['runs']} runs", goals)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workloads", default="prefix_repetition,multi_turn")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-blocks", type=int, default=128, help="each engine's paged cache, in 32-token blocks")
    ap.add_argument("--host-bytes", type=parse_bytes, default=parse_bytes("512MiB"), help="kvreel's host tier, each")
    add_workload_args(ap, 96)
    add_dtype_arg(ap)
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--detailed", action="store_true",
                    help="keep every request's TTFT; on prefix_repetition, tell first uses of a prefix from reuses")
    ap.add_argument("--warm", action="store_true",
                    help="prefix_repetition on a warm fleet: every prefix served once (another suffix) before "
                         "the measured requests, in every configuration")
    ap.add_argument("--name", default="fleet")
    ap.add_argument("--reanalyze", type=Path, help="a saved --detailed JSON: tell first uses apart again, redraw "
                                                   "its plots")
    a = ap.parse_args()
    if a.reanalyze:
        saved = json.loads(a.reanalyze.read_text())
        for k, v in saved["settings"]["prefix_repetition"].items():
            setattr(a, k, v)
        saved["first_uses"], lens = first_uses(a)
        saved["first_uses_told_by_commit"] = commit()
        saved["ttft_by_use"] = ttft_by_use(saved["results"]["prefix_repetition"], saved["first_uses"], lens)
        a.reanalyze.write_text(json.dumps(saved, indent=1))
        plot_fleet(a.reanalyze.stem, saved)
        plot_ttft_by_use(a.reanalyze.stem, saved)
        return
    with scratch("kvreel-fleet-") as work:
        all_workloads, turns = build_workloads(a, work)
        warm = {"prefix_repetition": warm_prompts(a)} if a.warm else {}
        results, failures = run_rounds(a.runs, a.workloads.split(","), a.configs.split(","), work,
                                       lambda c, w, where: run_once(c, all_workloads[w], a, where, warm.get(w)))
    ratios = {}
    for w, by in results.items():
        med = {c: v["median"]["request_throughput"]["median"] for c, v in by.items()}
        if "plain+cache_aware" in med:
            ratios[w] = {f"{c} / plain+cache_aware": med[c] / med["plain+cache_aware"] for c in med}
    cache_tokens = a.kv_blocks * BLOCK
    out = {"model": Path(a.model).name,
           "settings": {"engines": 2, "cores_per_engine": 1, "kv_blocks_per_engine": a.kv_blocks, "dtype": a.dtype,
                        "paged_cache_tokens_per_engine": cache_tokens, "kvreel_host_bytes_each": format_bytes(a.host_bytes),
                        "kvreel_remote": "Redis Cluster, 3 masters (Debian's redis-server), loopback",
                        "router": "vllm-router 0.1.17; kv_aware fed by vLLM's ZMQ KV events through a loopback relay",
                        "client": "vllm bench serve (vLLM's CLI) against the router, request rate inf, max "
                                  "concurrency 4, seed 0, ignore_eos", "runs": a.runs, "PYTHONHASHSEED": 0,
                        "warm": "each prefix served once (its own suffix, 1 token) before the measured requests, "
                                "counters and timings taken after" if a.warm else False,
                        **workload_settings(a, turns, cache_tokens)},
           "results": results, "throughput_ratios_of_medians": ratios, "failures": failures}
    detailed = a.detailed and "prefix_repetition" in results
    if detailed:
        out["first_uses"], lens = first_uses(a)
        out["ttft_by_use"] = ttft_by_use(results["prefix_repetition"], out["first_uses"], lens)
    path = save(a.name, out)
    plot_fleet(a.name, json.loads(path.read_text()))
    if detailed:
        plot_ttft_by_use(a.name, json.loads(path.read_text()))
    print(json.dumps(ratios, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
