"""A Redis Cluster master killed under a fleet's load: kvreel in two engines behind
vllm-router (``kv_aware``), the remote tier a cluster of 3 masters and 3 replicas.

    python bench/fleet_failover.py --model ../shared/models/tinycode-16m-4k

Requests (shared prefixes plus a suffix each, token ids, greedy) go through the
router, ``--concurrency`` at a time; a third of the way in, one master is killed
(SIGKILL) and its replica takes over. Reported: failed requests, TTFT before,
during and after, the remote tier's counters, and wrong tokens: every distinct
answer is checked teacher-forced against one idle plain vLLM engine (as in
``bench/soak.py``: a token more than ``--tolerance`` nats below the idle greedy
choice is wrong; answers put after a prompt they do not belong to show the check
can fail).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import python_source_corpus, read_counters, save, scratch, start_openai_server  # noqa: E402
from fleet import Fleet  # noqa: E402
from peers import add_dtype_arg  # noqa: E402
from soak import greedy_gaps  # noqa: E402

from kvreel.cli.server_process import stop_server  # noqa: E402

MEASURES = ("connector", "scheduler", "codec", "retrieval off")  # the package paths its figures measure (bench/report.py)


def complete(base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            out = json.loads(resp.read())
        return {"ok": True, "s": time.perf_counter() - t0, "answer": out["choices"][0]["token_ids"]}
    except OSError as e:
        return {"ok": False, "s": time.perf_counter() - t0, "error": str(e)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=128)
    ap.add_argument("--host-bytes", default="8MiB", help="kvreel's host tier, each: small, so the cluster serves")
    ap.add_argument("--max-model-len", type=int, default=3072)
    add_dtype_arg(ap)
    ap.add_argument("--tolerance", type=float, default=0.25)
    ap.add_argument("--name", default="fleet_failover")
    a = ap.parse_args()
    from transformers import AutoTokenizer
    from kvreel.connector.config import parse_bytes
    a.host_bytes = parse_bytes(a.host_bytes)
    tok = AutoTokenizer.from_pretrained(a.model)
    corpus = tok(python_source_corpus(4 * a.prefixes * a.prefix_len + a.requests * a.suffix_len))["input_ids"]
    rng = random.Random(0)
    prompts = []
    tail = corpus[a.prefixes * a.prefix_len:]
    for i in range(a.requests):
        p = rng.randrange(a.prefixes)
        prompts.append(corpus[p * a.prefix_len:(p + 1) * a.prefix_len] + tail[i * a.suffix_len:(i + 1) * a.suffix_len])
    with scratch("kvreel-fleet-failover-") as work:
        fleet = Fleet(True, "kv_aware", a, work, replicas=1)
        results: list[dict] = [None] * a.requests
        killed_at = {}
        try:
            kill_after = a.requests // 3
            done = threading.Semaphore(0)

            def one(i: int) -> None:
                results[i] = {**complete(fleet.router, a.model, prompts[i], a.output_len), "i": i,
                              "t": time.monotonic()}
                done.release()

            def killer() -> None:
                for _ in range(kill_after):
                    done.acquire()
                killed_at["t"] = time.monotonic()
                killed_at["port"] = fleet.kill_master()

            th = threading.Thread(target=killer)
            th.start()
            with ThreadPoolExecutor(a.concurrency) as pool:
                list(pool.map(one, range(a.requests)))
            th.join()
            counters = {e: read_counters(e, ("lookup_hit_blocks", "remote_upload_failures", "load_errors"))
                        for e in fleet.engines}
        finally:
            fleet.stop()
        ok = [r for r in results if r["ok"]]
        ref, ref_base = start_openai_server(a.model, ["--block-size", "32", "--enforce-eager", "--max-model-len",
                                                      str(a.max_model_len), "--gpu-memory-utilization", "0.05",
                                                      "--dtype", a.dtype],
                                            {"VLLM_CPU_KVCACHE_SPACE": "1"}, work / "reference.log")
        try:
            distinct = sorted({(r["i"] % len(prompts), tuple(r["answer"])) for r in ok})
            gaps = [g for i, ans in distinct for g in greedy_gaps(ref_base, prompts[i], list(ans), model=a.model)]
            foreign = [g for i, ans in distinct[::max(1, len(distinct) // 12)]
                       for g in greedy_gaps(ref_base, prompts[(i + 1) % len(prompts)], list(ans), model=a.model)]
        finally:
            stop_server(ref)
    t_kill = killed_at["t"]
    phases = {"before": [r["s"] for r in ok if r["t"] < t_kill],
              "after": [r["s"] for r in ok if r["t"] >= t_kill]}
    out = {"model": Path(a.model).name,
           "settings": {k: v for k, v in vars(a).items() if k != "model"} | {
               "cluster": "3 masters + 3 replicas (Debian's redis-server), cluster-node-timeout 1000 ms, loopback",
               "router": "vllm-router 0.1.17 kv_aware", "engines": "2, one core each, kvreel host tier + cluster",
               "killed": "one master, SIGKILL, after a third of the requests completed"},
           "requests": a.requests, "failed": a.requests - len(ok),
           "errors": sorted({r.get("error", "") for r in results if not r["ok"]}),
           "latency_s_median": {k: statistics.median(v) if v else None for k, v in phases.items()},
           "latency_s_max": {k: max(v) if v else None for k, v in phases.items()},
           "distinct_answers": len(distinct), "checked_tokens": len(gaps),
           "wrong_tokens": sum(g > a.tolerance for g in gaps), "max_gap_nats": max(gaps, default=0.0),
           "foreign_check": {"tokens": len(foreign), "flagged": sum(g > a.tolerance for g in foreign)},
           "counters": counters}
    path = save(a.name, out)
    print(json.dumps({k: v for k, v in out.items() if k != "settings"}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
