"""What the DRE's Mosaic index does as a long prompt grows past the point where
clusters narrow (16 K tokens at the defaults): clusters per head, their mean
size, and the DRE's time per 1 K tokens appended, on a trained model's keys.

    python bench/dre_growth.py --model models/smollm2-135m --yarn 4

The keys are SmolLM2-135M's (or ``--model``'s) post-RoPE keys over Python
source, captured in transformers with the model's RoPE stretched by YaRN as the
long-context suite serves it. Per layer of ``--layers``, the DRE service (in
this process, one torch thread, as its own process runs) clusters the first
``--build`` tokens, then extends the table a 128-token block at a time, as the
worker sends a prompt's blocks, naming as read (Mosaic's deferred splits) the
first 60 clusters the last labels hold per head, a stand-in for a working
set's clusters. Two settings in the same run:

* ``served``: a far token opens a cluster only while the clusters average at
  least 32 tokens (``MosaicIndex.min_mean_size``);
* baseline ``unbounded``: every token beyond its nearest cluster's threshold
  opens a cluster (kvreel before a34dda7).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import plot_lines, save  # noqa: E402
from kv_capture import capture  # noqa: E402

MEASURES = ("connector/retrieval", "dre")  # the package paths its figures measure (bench/report.py)

BLOCK, READ = 128, 60


def grow(keys: torch.Tensor, build: int, bound: bool) -> dict:
    """One layer's keys ``[H, T, D]`` (after the sink block) through the DRE."""
    from kvreel.dre.service import DREService
    svc = DREService()
    t0 = time.perf_counter()
    reply = svc.handle({"op": "cluster", "handle": "h", "method": "mosaic", "keys": keys[:, :build]})
    row = {"build_s": time.perf_counter() - t0, "clusters": [reply["clusters"]], "tokens": [build],
           "extend_s": []}
    if not bound:
        for session in svc.tables["h"][0]:
            session.index.min_mean_size = 0
    for at in range(build, keys.shape[1] - BLOCK + 1, BLOCK):
        read = [torch.unique(reply["labels"][h])[:READ] for h in range(keys.shape[0])]
        fetched = torch.stack([r[:min(map(len, read))] for r in read])
        t0 = time.perf_counter()
        reply = svc.handle({"op": "extend", "handle": "h", "keys": keys[:, at:at + BLOCK], "fetched": fetched})
        row["extend_s"].append(time.perf_counter() - t0)
        row["clusters"].append(reply["clusters"])
        row["tokens"].append(at + BLOCK)
    heads = keys.shape[0]
    row["table_bytes"] = reply["table_bytes"]
    row["clusters_per_head"] = row["clusters"][-1] / heads
    row["mean_cluster_tokens"] = row["tokens"][-1] * heads / row["clusters"][-1]
    row["extend_s_per_1k_tokens"] = sum(row["extend_s"]) / (len(row["extend_s"]) * BLOCK / 1000)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--yarn", type=float, default=4)
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--build", type=int, default=16384)
    ap.add_argument("--layers", default="2,15,28")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    kv, _ = capture(a.model, a.tokens + BLOCK, yarn=a.yarn)
    print(f"captured {tuple(kv.shape)} in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = {}
    for layer in (int(x) for x in a.layers.split(",")):
        keys = kv[layer, 0, BLOCK:].transpose(0, 1).float()                 # [H, T, D] after the sink block
        for name, bound in (("served", True), ("unbounded", False)):
            row = grow(keys, a.build, bound)
            rows[f"layer {layer}, {name}"] = row
            print(f"layer {layer} {name}: {row['clusters_per_head']:.0f} clusters/head, "
                  f"{row['mean_cluster_tokens']:.1f} tokens each, {row['extend_s_per_1k_tokens']:.3f} s per 1K",
                  flush=True)
    summary = {name: {k: statistics.median(r[k] for lbl, r in rows.items() if lbl.endswith(name))
                      for k in ("clusters_per_head", "mean_cluster_tokens", "extend_s_per_1k_tokens", "build_s")}
               for name in ("served", "unbounded")}
    settings = {"tokens": a.tokens, "build": a.build, "layers": a.layers, "yarn": a.yarn, "block": BLOCK,
                "read_clusters_per_head": READ, "dre": "DREService in this process, one torch thread"}
    path = save("dre_growth", {"model": Path(a.model).name, "settings": settings, "summary": summary,
                               "rows": rows})
    first = next(iter(rows.values()))
    plot_lines("dre_growth", first["tokens"],
               {label: [c / kv.shape[3] for c in r["clusters"]] for label, r in rows.items()},
               "history tokens", "DRE clusters per KV head",
               f"Mosaic's index as a prompt grows ({Path(a.model).name}, YaRN x{a.yarn:g}, Python source)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
