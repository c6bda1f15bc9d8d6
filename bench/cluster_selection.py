"""The papers' query-time selection over the DRE's clusters, for offline
analysis (``retrieval_quality.py``): ReSV's WiCSum (and its early-exit bucketed
variant) over hash-bit clusters, and Mosaic's two-stage selection (visual
groups, then their semantic clusters, a representative per group). A served
step does not use these: it ranks the clusters in the worker with its own
queries (``kvreel.connector.retrieval.history``)."""

from __future__ import annotations

import math

import torch

from kvreel.dre.mosaic import MosaicIndex
from kvreel.dre.resv import Clusters


def cluster_means(clusters: Clusters) -> torch.Tensor:
    return clusters.sums / clusters.counts.unsqueeze(1)


def cluster_tokens(clusters: Clusters, cluster_ids: torch.Tensor) -> torch.Tensor:
    """Sorted token ids of the given clusters (the HC table lookup)."""
    mask = torch.zeros(clusters.num_clusters, dtype=torch.bool)
    mask[cluster_ids.cpu()] = True
    return torch.nonzero(mask[clusters.labels], as_tuple=False).flatten()


def cluster_scores(queries: torch.Tensor, clusters: Clusters) -> torch.Tensor:
    """[R, D] query rows -> [R, C] predicted log-mass per cluster (log count + q.mean/sqrt d)."""
    d = queries.shape[-1]
    return queries.float() @ cluster_means(clusters).T / math.sqrt(d) + clusters.counts.float().log()


def frame_scores(scores: torch.Tensor) -> torch.Tensor:
    """[R, C] per-row log-masses -> [1, C]: the log of the rows' mean predicted
    attention distribution, for one selection per frame (what is fetched once
    and serves every row of the frame)."""
    return torch.softmax(scores, dim=-1).mean(0, keepdim=True).clamp_min(1e-30).log()


def wicsum(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """[R, C] log-masses -> [R, C] bool: per row, the clusters in descending mass
    until the kept mass reaches ``alpha`` of the row's total (at least one)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    mass = torch.softmax(scores, dim=-1)
    sorted_mass, order = torch.sort(mass, dim=-1, descending=True)
    before = sorted_mass.cumsum(-1) - sorted_mass           # mass kept before each cluster
    keep_sorted = before < alpha - 1e-7 if alpha < 1 else torch.ones_like(before, dtype=torch.bool)
    keep = torch.zeros_like(keep_sorted)
    return keep.scatter_(-1, order, keep_sorted)


def wicsum_bucketed(scores: torch.Tensor, alpha: float, buckets: int = 16) -> torch.Tensor:
    """WiCSum with the early-exit bucket sort: masses are bucketed on a log scale
    from the row's maximum; whole buckets are taken from the top while the
    threshold is not reached, and only the crossing bucket is sorted. Same
    selection as ``wicsum`` (ties aside), without a full sort per row."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    mass = torch.softmax(scores, dim=-1)
    R, C = mass.shape
    if alpha >= 1:
        return torch.ones_like(mass, dtype=torch.bool)
    logm = mass.clamp_min(1e-30).log()
    top = logm.max(-1, keepdim=True).values
    width = 2.0                                    # e^-2 per bucket: ~13 % of the level above
    b = ((top - logm) / width).floor().clamp(max=buckets - 1).to(torch.int64)
    bucket_mass = torch.zeros(R, buckets).scatter_add_(1, b, mass)
    cum = bucket_mass.cumsum(-1)
    crossing = (cum < alpha - 1e-7).sum(-1, keepdim=True).clamp(max=buckets - 1)   # first bucket reaching alpha
    keep = b < crossing                             # every bucket above the crossing one
    need = alpha - (cum.gather(1, crossing) - bucket_mass.gather(1, crossing))
    in_cross = b == crossing
    cross_mass = torch.where(in_cross, mass, torch.zeros_like(mass))
    k = int(in_cross.sum(-1).max())                 # only the crossing bucket is ordered
    sorted_mass, order = torch.topk(cross_mass, k, dim=-1)
    before = sorted_mass.cumsum(-1) - sorted_mass
    take_sorted = (before < need - 1e-7) & (sorted_mass > 0)
    take = torch.zeros_like(keep).scatter_(-1, order, take_sorted)
    return keep | take


# -- Mosaic ------------------------------------------------------------------------------

def mosaic_centroids(index: MosaicIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cents, visual = index.centroid_table()
    counts = torch.tensor([c.count for c in index.clusters], dtype=torch.float32)
    return cents, counts, visual


def mosaic_scores(index: MosaicIndex, queries: torch.Tensor) -> torch.Tensor:
    """[R, D] query rows -> [R, C] predicted log-mass (log size + q . centroid / sqrt d)."""
    cents, counts, _ = mosaic_centroids(index)
    return queries.float() @ cents.T / math.sqrt(queries.shape[-1]) + counts.log()


def mosaic_select(index: MosaicIndex, queries: torch.Tensor, alpha: float, visual_keep: float = 0.9) -> torch.Tensor:
    """[R, C] bool: two-stage WiCSum selection per query row, plus the global
    representative (strongest cluster) of every visual group. Stage 1 keeps
    visual groups up to max(alpha, visual_keep) of the mass; alpha = 1 keeps all."""
    return mosaic_select_scores(index, mosaic_scores(index, queries), alpha, visual_keep)


def mosaic_select_frame(index: MosaicIndex, queries: torch.Tensor, alpha: float,
                        visual_keep: float = 0.9) -> torch.Tensor:
    """[C] bool: one selection for a whole frame (what is fetched once and
    serves every row), on the rows' mean predicted attention distribution."""
    mass = torch.softmax(mosaic_scores(index, queries), dim=-1).mean(0)
    return mosaic_select_scores(index, mass.clamp_min(1e-30).log().unsqueeze(0), alpha, visual_keep)[0]


def mosaic_select_scores(index: MosaicIndex, scores: torch.Tensor, alpha: float,
                         visual_keep: float = 0.9) -> torch.Tensor:
    clusters = index.clusters
    if alpha >= 1:
        return torch.ones(scores.shape[0], len(clusters), dtype=torch.bool)
    visual = torch.tensor([c.visual for c in clusters])
    groups = torch.unique(visual)
    onehot = (visual.unsqueeze(0) == groups.unsqueeze(1)).float()           # [V, C]
    group_scores = torch.logsumexp(scores.unsqueeze(1) + (onehot.log()).unsqueeze(0), dim=-1)   # [R, V]
    keep_groups = wicsum(group_scores, max(alpha, visual_keep))             # stage 1
    allowed = (keep_groups.float() @ onehot) > 0                            # [R, C]
    stage2 = wicsum(scores.masked_fill(~allowed, float("-inf")), alpha) & allowed
    reps = torch.zeros_like(stage2)
    masked = scores.unsqueeze(1).expand(-1, len(groups), -1).masked_fill(onehot.unsqueeze(0) == 0, float("-inf"))
    reps.scatter_(1, masked.argmax(-1), True)                               # one per visual group
    return stage2 | reps


def token_mask(index: MosaicIndex, cluster_mask: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[R, C] cluster selection -> [R, n_tokens] token selection."""
    owner = index.owners(n_tokens)
    valid = owner >= 0
    out = torch.zeros(cluster_mask.shape[0], n_tokens, dtype=torch.bool)
    out[:, valid] = cluster_mask[:, owner[valid]]
    return out
