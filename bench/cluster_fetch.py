"""Fetch rate of selected clusters from the host tier: KVMU's cluster-contiguous
layout (one copy per run of clusters) vs the per-token layout (gather, then
copy), same tokens, same run.

    python bench/cluster_fetch.py [--tokens 40960] [--device cuda]

One (layer, KV head) of bf16 K+V, head_dim 64; clusters from ReSV hashing of
keys drawn around 256 centres (synthetic: only the cluster sizes matter);
share of clusters selected: 5 % to 50 %. Destination: the CPU here, the GPU
with ``--device cuda`` (pinned source, so each run is one DMA).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import plot_lines, save  # noqa: E402

from kvreel.connector.retrieval.kvmu import ClusterLayout, fetch_tokens  # noqa: E402
from kvreel.connector.retrieval.resv import cluster_keys, hyperplanes  # noqa: E402

SHARES = (0.05, 0.1, 0.2, 0.3, 0.5)


def timed(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40960)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    T, D = a.tokens, 64
    centres = torch.randn(256, D, generator=g) * 2
    keys = centres[torch.randint(0, 256, (T,), generator=g)] + 0.5 * torch.randn(T, D, generator=g)
    values = torch.randn(T, D, generator=g)
    labels = cluster_keys(keys, hyperplanes(D, 12, seed=1), 1).labels
    keys, values = keys.bfloat16(), values.bfloat16()
    pin = a.device == "cuda"
    layout = ClusterLayout(keys, values, labels, pin=pin)
    src_k, src_v = (keys.pin_memory(), values.pin_memory()) if pin else (keys, values)
    C = int(layout.counts.numel())
    rows = []
    for share in tqdm(SHARES, desc="selected shares"):
        chosen = torch.randperm(C, generator=g)[:max(1, int(share * C))]
        ids, _ = layout.fetch(chosen, a.device)
        nbytes = len(ids) * 2 * D * 2
        t_cluster = timed(lambda: layout.fetch(chosen, a.device), a.device, a.repeats)
        t_token = timed(lambda: fetch_tokens(src_k, src_v, ids, a.device), a.device, a.repeats)
        row = {"cluster_share": share, "tokens": len(ids), "copies": len(layout.runs(chosen)),
               "clustered_GBps": round(nbytes / t_cluster / 1e9, 3), "per_token_GBps": round(nbytes / t_token / 1e9, 3)}
        rows.append(row)
        tqdm.write(str(row))
    name = "cluster_fetch" if a.device == "cpu" else f"cluster_fetch_{a.device}"
    save(name, {"setting": {"tokens": T, "head_dim": D, "dtype": "bfloat16", "clusters": C, "device": a.device},
                "rows": rows})
    plot_lines(name, [r["cluster_share"] for r in rows],
               {"cluster-contiguous (KVMU)": [r["clustered_GBps"] for r in rows],
                "per-token layout (gather)": [r["per_token_GBps"] for r in rows]},
               "share of clusters selected", "GB/s", f"fetch of selected clusters, {T} tokens, to {a.device}")


if __name__ == "__main__":
    main()
