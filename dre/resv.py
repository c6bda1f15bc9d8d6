"""ReSV (V-Rex): hash-bit key clustering and WiCSum cluster selection.

Clustering, per layer and KV head: post-RoPE keys, centred on the history's
mean key, are projected onto random hyperplanes, their signs form a
``bits``-bit hash, and a token joins the first cluster whose hash is within
``hamming`` bits of its own (else it opens a new cluster). The HC table maps
each cluster to its tokens; a cluster is represented by the mean of its keys
and its size. Centring matters: a head's keys share a large common offset, so
hyperplanes through the origin would cut most of them the same way (on
SmolLM2-135M centring cut the tokens needed for 1 % error by 26 % at 12 bits
and 36 % at 14, ``bench/retrieval_quality.py``).

Selection, per layer, KV head and query row: a cluster's predicted attention
mass is ``count * exp(q . mean_key / sqrt(d))``; clusters are kept in
descending score order until the kept mass reaches ``alpha`` of the row's total
(WiCSum), instead of a fixed top-k. ``wicsum_bucketed`` is the early-exit
variant: scores fall into coarse buckets from the top, only the bucket where the
threshold is crossed is sorted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Hash bits (centred keys). The clusters narrow a long history to the tokens a step
# scores exactly (``LayerHistory.candidates``): ranking them must cost far less than
# scoring every token, so a layer has at most 2^bits of them (on SmolLM2-135M's keys
# 16 bits left nearly one cluster per token).
HASH_BITS = 12


@dataclass
class Clusters:
    """One (layer, KV head)'s HC table: ``labels[t]`` is token t's cluster."""
    labels: torch.Tensor        # [T] int64
    sums: torch.Tensor          # [C, D] float32, key sums (the mean is the representative key)
    counts: torch.Tensor        # [C] int64
    codes: torch.Tensor         # [C] int64, each cluster's hash
    center: torch.Tensor        # [D] float32, subtracted before hashing (fixed as the table grows)

    @property
    def num_clusters(self) -> int:
        return int(self.counts.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.labels, self.sums, self.counts, self.codes, self.center))

    @property
    def means(self) -> torch.Tensor:
        return self.sums / self.counts.unsqueeze(1)

    def tokens(self, cluster_ids: torch.Tensor) -> torch.Tensor:
        """Sorted token ids of the given clusters (the HC table lookup)."""
        mask = torch.zeros(self.num_clusters, dtype=torch.bool)
        mask[cluster_ids.cpu()] = True
        return torch.nonzero(mask[self.labels], as_tuple=False).flatten()


def hyperplanes(head_dim: int, bits: int, seed: int = 0) -> torch.Tensor:
    if not 1 <= bits <= 62:
        raise ValueError(f"bits must be in [1, 62], got {bits}")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, bits, generator=g)


def hash_keys(keys: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """[T, D] keys -> [T] int64 sign-bit hashes."""
    signs = (keys.float() @ planes) > 0
    weights = 2 ** torch.arange(planes.shape[1], dtype=torch.int64)
    return (signs.to(torch.int64) * weights).sum(-1)


def _popcount(x: torch.Tensor) -> torch.Tensor:
    count = torch.zeros_like(x)
    for _ in range(63):
        if not bool(x.any()):
            break
        count += x & 1
        x = x >> 1
    return count


def cluster_keys(keys: torch.Tensor, planes: torch.Tensor, hamming: int,
                 center: torch.Tensor | None = None) -> Clusters:
    """Greedy Hamming clustering of one head's keys (tokens in order), hashed
    after subtracting ``center`` (default: their mean)."""
    keys = keys.float()
    center = keys.mean(0) if center is None else center.float()
    empty = torch.empty(0, dtype=torch.int64)
    return extend_clusters(Clusters(empty, torch.empty(0, keys.shape[1]), empty, empty, center),
                           keys, planes, hamming)


def extend_clusters(cl: Clusters, keys: torch.Tensor, planes: torch.Tensor, hamming: int) -> Clusters:
    """The HC table after appending ``keys`` (the tokens after ``cl``'s, in order):
    the table clustering all tokens at once gives, without revisiting the old
    tokens (a growing session pays only for its new ones)."""
    codes = hash_keys(keys.float() - cl.center, planes)
    uniq, inverse = torch.unique(codes, return_inverse=True)
    # tokens sharing a hash always share a cluster: assign unique hashes, in the
    # order they first appear, to the first center within `hamming` bits
    first = torch.full((uniq.numel(),), keys.shape[0], dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(keys.shape[0]), reduce="amin")
    order = torch.argsort(first)
    C = cl.num_clusters
    code_cluster = torch.empty(uniq.numel(), dtype=torch.int64)
    if hamming == 0:              # exact matches, then new clusters by first appearance (no loop needed)
        found = torch.zeros(uniq.numel(), dtype=torch.bool)
        if C:
            known, perm = torch.sort(cl.codes)
            pos = torch.searchsorted(known, uniq).clamp(max=C - 1)
            found = known[pos] == uniq
            code_cluster[found] = perm[pos[found]]
        opened = order[~found[order]]
        code_cluster[opened] = C + torch.arange(opened.numel())
        cluster_codes = torch.cat([cl.codes, uniq[opened]])
    else:
        cluster_codes = cl.codes
        for u in order.tolist():
            code = uniq[u]
            if cluster_codes.numel():
                near = torch.nonzero(_popcount(cluster_codes ^ code) <= hamming, as_tuple=False)
                if near.numel():
                    code_cluster[u] = int(near[0])
                    continue
            code_cluster[u] = cluster_codes.numel()
            cluster_codes = torch.cat([cluster_codes, code.view(1)])
    labels = code_cluster[inverse]
    grown = cluster_codes.numel() - C
    counts = torch.cat([cl.counts, torch.zeros(grown, dtype=torch.int64)])
    counts += torch.bincount(labels, minlength=cluster_codes.numel())
    sums = torch.cat([cl.sums, torch.zeros(grown, keys.shape[1])])
    sums.index_add_(0, labels, keys.float())
    return Clusters(torch.cat([cl.labels, labels]), sums, counts, cluster_codes, cl.center)


def cluster_scores(queries: torch.Tensor, clusters: Clusters) -> torch.Tensor:
    """[R, D] query rows -> [R, C] predicted log-mass per cluster (log count + q.mean/sqrt d)."""
    d = queries.shape[-1]
    return queries.float() @ clusters.means.T / math.sqrt(d) + clusters.counts.float().log()


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
