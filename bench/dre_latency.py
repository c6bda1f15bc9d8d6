"""DRE prediction latency per layer vs cached tokens, and how much of it hides
behind attention when asked a layer ahead (as the retrieval backend does).

    python bench/dre_latency.py [--tokens 1024,2048,...,40960] [--frame 128] [--method resv|mosaic]

The DRE runs as its own process (Unix socket + shared memory, as in serving).
Keys: KV-head-shaped like tinycode-16m (2 KV heads, head_dim 64, 6 query heads),
drawn around 64 centres per head (synthetic: latency does not depend on what
the keys say, only on their count and clusters). Per cache size:

* cluster: clustering one layer's whole history (ReSV: hashing + Hamming
  clustering; Mosaic: k-means), done when the DRE first sees a history;
* extend: growing that table by one new history block (32 tokens), what a
  running session pays per new block; baseline in the same run: clustering
  the whole grown history anew;
* mass: the per-token mass prediction for one layer and one step (``--frame``
  query tokens x 3 query heads per KV head), alone;
* hidden: the same prediction submitted before the layer's attention and
  collected after it: 1 - (wait after attention) / (mass alone). The attention
  is what a long request's layer computes as served: float32 SDPA of the frame
  over a working set of ``--budget`` tokens (baseline in the same run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import plot_lines, save  # noqa: E402

from kvreel.connector.retrieval.dre_service import DREProcess  # noqa: E402

H, G, D, BLOCK = 2, 3, 64, 32


def keys_for(T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(H, 64, D, generator=g) * 2
    pick = torch.randint(0, 64, (H, T), generator=g)
    return torch.gather(centres, 1, pick.unsqueeze(-1).expand(H, T, D)) + 0.5 * torch.randn(H, T, D, generator=g)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One layer's attention of the frame over the cache (GQA, no K/V copies), float32."""
    return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                            enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384,32768,40960")
    ap.add_argument("--frame", type=int, default=128, help="query tokens per step (1: decoding)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument("--method", choices=("resv", "mosaic"), default="resv")
    ap.add_argument("--budget", type=int, default=2048, help="working-set tokens the layer attends to")
    a = ap.parse_args()
    sizes = [int(t) for t in a.tokens.split(",")]
    proc = DREProcess(tempfile.mkdtemp(prefix="kvreel-dre-bench-") + "/dre.sock")   # as the worker starts it
    client = proc.start()
    rows = []
    try:
        warm = keys_for(sizes[0], seed=1)          # first calls pay for imports and allocator growth
        client.submit("cluster", handle="warm", keys=warm[:, :-BLOCK], method=a.method).result(600)
        client.submit("extend", handle="warm", keys=warm[:, -BLOCK:]).result(600)
        client.submit("mass", handle="warm", queries=warm[:, :G * a.frame], alpha=a.alpha).result(600)
        client.submit("drop", handle="warm").result(10)
        for T in tqdm(sizes, desc="cache sizes"):
            keys = keys_for(T)
            ws = min(T, a.budget)
            values = torch.randn(H, ws, D)
            q = keys[:, torch.randint(0, T, (a.frame * G,))].reshape(H * G, a.frame, D) * 0.5
            queries = q.reshape(H, G * a.frame, D)

            def select():
                return client.submit("mass", handle=f"T{T}", queries=queries, alpha=a.alpha)
            client.submit("cluster", handle=f"T{T}-grown", keys=keys[:, :T - BLOCK], method=a.method).result(600)
            t0 = time.perf_counter()
            client.submit("extend", handle=f"T{T}-grown", keys=keys[:, T - BLOCK:]).result(600)
            extend_ms = (time.perf_counter() - t0) * 1000
            client.submit("drop", handle=f"T{T}-grown")
            t0 = time.perf_counter()
            client.submit("cluster", handle=f"T{T}", keys=keys, method=a.method).result(600)
            cluster_ms = (time.perf_counter() - t0) * 1000
            select(), select().result(60)                       # warm
            alone, attn, hidden = [], [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                select().result(60)
                alone.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                attention(q, keys[:, :ws], values)
                attn.append(time.perf_counter() - t0)
            for _ in range(a.repeats):
                fut = select()                                  # asked a layer ahead...
                attention(q, keys[:, :ws], values)              # ...while this layer attends
                t1 = time.perf_counter()
                fut.result(60)
                hidden.append(time.perf_counter() - t1)
            sel = statistics.median(alone)
            row = {"tokens": T, "cluster_ms": round(cluster_ms, 2), "extend_ms": round(extend_ms, 2),
                   "mass_ms": round(sel * 1000, 3),
                   "attention_ms": round(statistics.median(attn) * 1000, 3),
                   "wait_after_attention_ms": round(statistics.median(hidden) * 1000, 3),
                   "hidden_fraction": round(max(0.0, 1 - statistics.median(hidden) / sel), 3)}
            rows.append(row)
            tqdm.write(str(row))
            client.submit("drop", handle=f"T{T}").result(10)
    finally:
        client.close()
        proc.stop()
    name = ("dre_latency" if a.frame > 1 else "dre_latency_decode") + ("_mosaic" if a.method == "mosaic" else "")
    save(name, {"setting": {"method": a.method, "kv_heads": H, "query_heads": H * G, "head_dim": D,
                            "frame_tokens": a.frame, "working_set_tokens": a.budget,
                            "alpha": a.alpha, "page": BLOCK, "keys": "synthetic, 64 centres per head"},
                "rows": rows})
    x = [r["tokens"] for r in rows]
    plot_lines(name, x, {"DRE mass prediction (one layer, one step)": [r["mass_ms"] for r in rows],
                         "DRE clustering the whole history (baseline)": [r["cluster_ms"] for r in rows],
                         "DRE extending by one new block": [r["extend_ms"] for r in rows],
                         "attention of the layer over its working set (baseline)": [r["attention_ms"] for r in rows],
                         "wait left after attention (asked a layer ahead)": [r["wait_after_attention_ms"]
                                                                             for r in rows]},
               "cached tokens", "ms", f"DRE ({a.method}) latency per layer, frame of {a.frame} tokens, 2-core CPU",
               logy=True)


if __name__ == "__main__":
    main()
