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

The DRE only clusters. A served step ranks these clusters in the worker with
its own queries (``kvreel.connector.retrieval.history``); the papers' query-time
selection over clusters (WiCSum and its bucketed variant) is offline analysis,
in ``bench/cluster_selection.py``.
"""

from __future__ import annotations

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
