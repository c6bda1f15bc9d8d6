"""Retrieval quality on a trained model over real text: attention-output error and
attention-mass recall vs the share of history tokens fetched, for ReSV and the
top-k baselines, in one run.

    python bench/retrieval_quality.py --model ../shared/models/tinycode-16m-4k --tokens 4096

Setting (as in the issue): the last ``--frame`` tokens are the new "frame"; their
queries (every query head of a KV group, every frame token: the rows) attend to
the history and, causally, to the frame itself. ``--sink`` first and
``--window`` last history tokens and the frame are always kept; every method
chooses among the rest of the history. Per layer and KV head: exact output
O = softmax(q K^T / sqrt d) V; a method's output uses only its selection.
Error = ||O' - O|| / ||O||, recall = attention mass kept, fetched = history
tokens in the union of the frame's selections (a fetched token serves every
row) over the candidates. Means over layers and heads.

Methods: ReKV (the history cut into segments of ``--frame`` tokens, standing in
for video frames; a segment's score is the cosine of the frame's mean query and
the segment's mean key; whole segments fetched, fixed top-k), frame top-k with
oracle frame scores (ReKV's best case at token granularity: a bound), per-row
top-k (InfiniGen style; exact scores), Quest pages (per-page key min/max bound),
per-row WiCSum on oracle mass (a bound, not a method), ReSV: hash-bit clusters
of post-RoPE keys (centred on their mean, as served, or not), WiCSum on
*predicted* mass (cluster size x exp(q . mean key)) per row or once per frame
(on the rows' mean predicted distribution), whole clusters fetched, and Mosaic (nested visual/semantic
clusters, two-stage WiCSum per frame, text segments standing in for frames).
This is the algorithms' design space on captured Q/K/V; what the serving path
does (previous-layer prediction, one page set per layer, the real sink and
window) is measured by ``retrieval_served.py`` through vLLM itself.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import save, save_figure  # noqa: E402
from kv_capture import capture_qkv  # noqa: E402

from cluster_selection import (cluster_scores, frame_scores, mosaic_select, mosaic_select_frame,  # noqa: E402
                               token_mask, wicsum)

from kvreel.dre.mosaic import MosaicIndex, cosine_kmeans  # noqa: E402
from kvreel.dre.resv import cluster_keys, hyperplanes  # noqa: E402

MEASURES = ("connector/retrieval", "dre")  # the package paths its figures measure (bench/report.py)

RATIOS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7)
ALPHAS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999)
REKV_RATIOS = RATIOS + (0.8, 0.9, 1.0)
# (bits, hamming radius, keys centred before hashing: the serving default)
RESV_CONFIGS = ((12, 0, False), (14, 0, False), (12, 0, True), (14, 0, True), (16, 0, True), (16, 1, True))
MOSAIC_CONFIGS = (16, 64)                            # semantic clusters per visual cluster


def prefetch_hit_rate(index_next: MosaicIndex, queries_this: torch.Tensor, queries_next: torch.Tensor,
                      alpha: float) -> tuple[float, torch.Tensor]:
    """Cross-layer prefetch: clusters of layer l+1 predicted from layer l's queries;
    (share of the real layer-(l+1) selection that was prefetched, the clusters the
    completion step must still fetch)."""
    predicted = mosaic_select(index_next, queries_this, alpha).any(0)
    actual = mosaic_select(index_next, queries_next, alpha).any(0)
    missed = actual & ~predicted
    hit = float((actual & predicted).sum() / actual.sum().clamp_min(1))
    return hit, torch.nonzero(missed).flatten()


def evaluate(q, k, v, mask, cand, visible):
    """Error, recall, fetched share of one selection ``mask`` [R, N] over candidates
    ``cand``; ``visible`` [R, N]: what each row may attend to (causal)."""
    d = q.shape[-1]
    logits = (q @ k.T / math.sqrt(d)).masked_fill(~visible, float("-inf"))
    p = torch.softmax(logits, -1)
    exact = p @ v
    restricted = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    out = restricted @ v
    err = float((out - exact).norm() / exact.norm())
    recall = float((p * mask).sum(-1).mean())
    fetched = float((mask.any(0) & cand).sum() / cand.sum())
    return err, recall, fetched


def methods(q, k, v, always, cand, visual, segment: int, page: int = 16):
    """Yields (method, parameter, mask [R, N]); ``always`` [R, N] is kept by every method."""
    R, N = q.shape[0], k.shape[0]
    d = q.shape[-1]
    logits = (q @ k.T / math.sqrt(d)).masked_fill(~(always | cand), float("-inf"))
    p = torch.softmax(logits, -1)
    ncand = int(cand.sum())

    def with_always(m):
        return m | always
    frame_score = p.mean(0).masked_fill(~cand, -1)
    for r in RATIOS:
        n = max(1, int(r * ncand))
        top = torch.topk(frame_score, n).indices
        m = torch.zeros(N, dtype=torch.bool)
        m[top] = True
        yield "frame top-k, oracle (bound)", r, with_always(m.expand(R, N))
    idx = torch.nonzero(cand).flatten()
    seg = idx // segment
    seg_keys = torch.zeros(int(seg.max()) + 1, d).index_add_(0, seg, k[idx])    # sums: cosine ignores the count
    seg_score = torch.nn.functional.cosine_similarity(seg_keys, q.mean(0, keepdim=True), dim=-1)
    for r in REKV_RATIOS:
        n = max(1, round(r * seg_keys.shape[0]))
        m = torch.zeros(N, dtype=torch.bool)
        m[idx[torch.isin(seg, torch.topk(seg_score, n).indices)]] = True
        yield "ReKV frames", r, with_always(m.expand(R, N))
    row_score = logits.masked_fill(~cand, float("-inf"))
    for r in RATIOS:
        n = max(1, int(r * ncand))
        top = torch.topk(row_score, n, dim=-1).indices
        yield "row top-k (InfiniGen)", r, with_always(torch.zeros(R, N, dtype=torch.bool).scatter_(1, top, True))
    # Quest: pages of candidates, score bound sum_d max(q_d min_d, q_d max_d)
    pages = [idx[i:i + page] for i in range(0, idx.numel(), page)]
    kmin = torch.stack([k[pg].min(0).values for pg in pages])
    kmax = torch.stack([k[pg].max(0).values for pg in pages])
    bound = torch.maximum(q.unsqueeze(1) * kmin, q.unsqueeze(1) * kmax).sum(-1)     # [R, pages]
    for r in RATIOS:
        n = max(1, int(r * len(pages)))
        top = torch.topk(bound, n, dim=-1).indices
        m = torch.zeros(R, N, dtype=torch.bool)
        for j, pg in enumerate(pages):
            m[:, pg] |= (top == j).any(-1, keepdim=True)
        yield "Quest pages", r, with_always(m)
    cand_mass = p.masked_fill(~cand, 0)
    for a in ALPHAS:
        scores = cand_mass[:, idx].clamp_min(1e-30).log()
        keep = wicsum(scores, a)
        m = torch.zeros(R, N, dtype=torch.bool)
        m[:, idx] = keep
        yield "row WiCSum, oracle mass (bound)", a, with_always(m)
    for bits, ham, centred in RESV_CONFIGS:
        cl = cluster_keys(k[idx], hyperplanes(d, bits, seed=1), ham, None if centred else torch.zeros(d))
        s = cluster_scores(q, cl)
        name = f"ReSV {bits}b/h{ham}{'' if centred else ' uncentred'}"
        for a in ALPHAS:
            if (bits, ham, centred) == RESV_CONFIGS[0]:
                m = torch.zeros(R, N, dtype=torch.bool)
                m[:, idx] = wicsum(s, a)[:, cl.labels]                   # each row its own clusters
                yield f"{name} per row", a, with_always(m)
            m = torch.zeros(R, N, dtype=torch.bool)
            m[:, idx] = wicsum(frame_scores(s), a)[0, cl.labels]         # one fetch per frame
            yield f"{name} per frame", a, with_always(m)
    frame_of, visual_labels = visual
    for per_visual in MOSAIC_CONFIGS:
        index = MosaicIndex.build(k[idx], frame_of[idx], visual_labels, per_visual)
        for a in ALPHAS:
            m = torch.zeros(R, N, dtype=torch.bool)
            m[:, idx] = token_mask(index, mosaic_select_frame(index, q, a).unsqueeze(0), idx.numel())
            yield f"Mosaic {per_visual}/visual per frame", a, with_always(m)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--frame", type=int, default=128)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--visual-clusters", type=int, default=8)
    a = ap.parse_args()
    q, k, v = capture_qkv(a.model, a.tokens)
    L, Hq, T, D = q.shape
    Hkv = k.shape[1]
    hist = T - a.frame
    cand = torch.zeros(T, dtype=torch.bool)
    cand[a.sink: hist - a.window] = True
    causal = torch.arange(T).unsqueeze(0) <= torch.arange(hist, T).unsqueeze(1)        # [frame, T]
    # text segments of --frame tokens stand in for video frames; a segment's
    # embedding is its mean normalized key over layers and heads
    frame_of = torch.arange(hist) // a.frame
    nf = int(frame_of.max()) + 1
    kn = torch.nn.functional.normalize(k[:, :, :hist], dim=-1).mean((0, 1))        # [hist, D]
    emb = torch.zeros(nf, D).index_add_(0, frame_of, kn)
    frame_of = torch.cat([frame_of, torch.full((a.frame,), nf)])                 # the new frame: its own id
    visual = (frame_of, torch.cat([cosine_kmeans(emb, a.visual_clusters), torch.tensor([0])]))
    prefetch = []
    curves: dict[str, dict[float, list[tuple[float, float, float]]]] = {}
    per_head: dict[str, dict[float, list[list[float]]]] = {}
    for layer in tqdm(range(L), desc="layers"):
        for h in range(Hkv):
            group = range(h * Hq // Hkv, (h + 1) * Hq // Hkv)
            rows = torch.cat([q[layer, g, hist:] for g in group])
            kk, vv = k[layer, h], v[layer, h]
            visible = causal.repeat(len(group), 1)
            always = ~cand.unsqueeze(0) & visible       # sinks, window and the frame itself (causal)
            for name, param, mask in methods(rows, kk, vv, always, cand, visual, a.frame):
                res = evaluate(rows, kk, vv, mask & visible, cand, visible)
                curves.setdefault(name, {}).setdefault(param, []).append(res)
                per_head.setdefault(name, {}).setdefault(param, []).append([layer, h, res[2], res[0]])
            if layer + 1 < L:          # cross-layer prefetch: layer l's rows predict layer l+1's clusters
                idx = torch.nonzero(cand).flatten()
                nxt = MosaicIndex.build(k[layer + 1, h, idx], frame_of[idx], visual[1], MOSAIC_CONFIGS[-1])
                rows_next = torch.cat([q[layer + 1, g, hist:] for g in group])
                prefetch.append(prefetch_hit_rate(nxt, rows, rows_next, 0.95)[0])
    summary = {}
    for name, by_param in curves.items():
        pts = []
        for param, res in sorted(by_param.items()):
            err, rec, fet = (sum(x[i] for x in res) / len(res) for i in range(3))
            pts.append({"param": param, "error": err, "recall": rec, "fetched": fet})
        summary[name] = pts
    needed = {name: _fetched_at(pts, 0.01) for name, pts in summary.items()}
    def best(prefix):
        return min((n for n in needed if n.startswith(prefix) and needed[n] is not None),
                   key=lambda n: needed[n], default=None)
    best_resv, best_mosaic = best("ReSV"), best("Mosaic")
    frame, rekv = needed.get("frame top-k, oracle (bound)"), needed.get("ReKV frames")

    def ratio(method, base):
        return needed[method] / base if method and base else None
    out = {"model": a.model, "tokens": a.tokens, "frame": a.frame, "sink": a.sink, "window": a.window,
           "shape": {"layers": L, "q_heads": Hq, "kv_heads": Hkv, "head_dim": D},
           "curves": summary, "fetched_at_1pct_error": needed,
           "mosaic_cross_layer_prefetch_hit_rate": sum(prefetch) / len(prefetch) if prefetch else None,
           "resv_vs_frame_topk_at_1pct": ratio(best_resv, frame), "resv_vs_rekv_at_1pct": ratio(best_resv, rekv),
           "best_resv": best_resv, "best_mosaic": best_mosaic,
           "mosaic_vs_frame_topk_at_1pct": ratio(best_mosaic, frame),
           "mosaic_vs_rekv_at_1pct": ratio(best_mosaic, rekv)}
    if best_resv:
        alpha = min((p for p in summary[best_resv] if p["error"] <= 0.01), key=lambda p: p["fetched"],
                    default=summary[best_resv][-1])["param"]
        out["heatmap"] = {"method": best_resv, "alpha": alpha, "cells": per_head[best_resv][alpha]}
        _heatmap(out["heatmap"], L, Hkv, f"retrieval_ratio_heatmap_{Path(a.model).name}")
    name = f"retrieval_quality_{Path(a.model).name}"
    path = save(name, out)
    _plot(summary, name)
    print("fetched share at 1% error:", {k: (round(v, 3) if v else v) for k, v in needed.items()})
    print("wrote", path)


def _fetched_at(pts, target):
    """Smallest fetched share with error <= target, interpolated between the two
    sweep points around it (None if never reached)."""
    pts = sorted(pts, key=lambda p: p["fetched"])
    prev = None
    for p in pts:
        if p["error"] <= target:
            if prev is None or prev["error"] == p["error"]:
                return p["fetched"]
            t = (prev["error"] - target) / (prev["error"] - p["error"])
            return prev["fetched"] + t * (p["fetched"] - prev["fetched"])
        prev = p
    return None


def _plot(summary, out_name):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (name, pts) in enumerate(summary.items()):
        pts = sorted((p for p in pts if p["error"] > 0), key=lambda p: p["fetched"])     # log axis
        style = {"marker": ".", "label": name, "color": colors[i % len(colors)],
                 "ls": "--" if "bound" in name else "-"}
        axes[0].plot([p["fetched"] for p in pts], [p["error"] * 100 for p in pts], **style)
        axes[1].plot([p["fetched"] for p in pts], [p["recall"] for p in pts], **style)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("attention output error (%)")
    axes[1].set_ylabel("attention mass recall")
    for ax in axes:
        ax.set_xlabel("history tokens fetched (share)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    save_figure(fig, out_name)


def _heatmap(hm, L, H, name):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grid = torch.zeros(L, H)
    for layer, h, fetched, _ in hm["cells"]:
        grid[int(layer), int(h)] = fetched
    fig, ax = plt.subplots(figsize=(3 + H, 3.5 + L / 10))
    im = ax.imshow(grid.numpy(), cmap="viridis", aspect="auto")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(f"{hm['method']} alpha={hm['alpha']}: share fetched", fontsize=9)
    fig.colorbar(im)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
