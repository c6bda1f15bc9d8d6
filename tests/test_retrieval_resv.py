"""ReSV hash-bit clustering (the DRE) and WiCSum selection over its clusters
(offline analysis, bench/cluster_selection.py)."""

import sys
from pathlib import Path

import pytest
import torch

from kvreel.dre.resv import cluster_keys, extend_clusters, hash_keys, hyperplanes

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from cluster_selection import (cluster_means, cluster_scores, cluster_tokens, frame_scores,  # noqa: E402
                               wicsum, wicsum_bucketed)


def keys(T=512, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(12, D, generator=g) * 3
    return centers[torch.randint(0, 12, (T,), generator=g)] + 0.3 * torch.randn(T, D, generator=g)


def test_hashes_are_sign_bits_of_the_projections():
    k, planes = keys(), hyperplanes(64, 10, seed=1)
    codes = hash_keys(k, planes)
    bits = ((k @ planes) > 0).long()
    assert torch.equal(codes, (bits * (2 ** torch.arange(10))).sum(-1))
    assert torch.equal(hash_keys(k, hyperplanes(64, 10, seed=1)), codes)     # seeded: reproducible


@pytest.mark.parametrize("hamming", [0, 1, 2])
def test_clusters_partition_tokens_and_respect_the_hamming_radius(hamming):
    k, planes = keys(), hyperplanes(64, 12)
    cl = cluster_keys(k, planes, hamming)
    assert int(cl.counts.sum()) == k.shape[0] and bool((cl.counts > 0).all())
    assert torch.allclose(cl.center, k.mean(0))
    codes = hash_keys(k - k.mean(0), planes)          # hashed centred
    for c in range(cl.num_clusters):
        members = (cl.labels == c)
        assert torch.allclose(cluster_means(cl)[c], k[members].mean(0), atol=1e-5)
        xor = codes[members] ^ cl.codes[c]
        assert max(bin(int(x)).count("1") for x in xor) <= hamming
    same = codes.unsqueeze(0) == codes.unsqueeze(1)          # equal hashes share a cluster
    assert bool((cl.labels.unsqueeze(0) == cl.labels.unsqueeze(1))[same].all())
    assert torch.equal(cluster_tokens(cl, torch.tensor([0])), torch.nonzero(cl.labels == 0).flatten())
    first_seen = [int(torch.nonzero(cl.labels == c)[0]) for c in range(cl.num_clusters)]
    assert first_seen == sorted(first_seen) and first_seen[0] == 0      # numbered by first appearance
    if hamming == 0:
        assert cl.num_clusters == torch.unique(codes).numel()


@pytest.mark.parametrize("hamming", [0, 1, 2])
def test_a_table_extended_block_by_block_is_the_table_of_all_tokens(hamming):
    k, planes = torch.cat([keys(T=300), keys(T=400, seed=1)]), hyperplanes(64, 12)     # later tokens: new topics
    grown = cluster_keys(k[:300], planes, hamming)       # centred on the first tokens, kept as it grows
    whole = cluster_keys(k, planes, hamming, center=k[:300].mean(0))
    for start in range(300, 700, 32):
        grown = extend_clusters(grown, k[start:start + 32], planes, hamming)
    assert whole.num_clusters > cluster_keys(k[:300], planes, hamming).num_clusters     # new clusters opened
    for field in ("labels", "counts", "codes"):
        assert torch.equal(getattr(grown, field), getattr(whole, field)), field
    assert torch.allclose(cluster_means(grown), cluster_means(whole), atol=1e-5)


def test_wider_radius_gives_fewer_clusters():
    k, planes = keys(), hyperplanes(64, 16)
    sizes = [cluster_keys(k, planes, h).num_clusters for h in (0, 1, 2, 3)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9, 0.99])
def test_wicsum_keeps_the_fewest_clusters_reaching_alpha(alpha):
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(32, 200, generator=g) * 2
    keep = wicsum(scores, alpha)
    mass = torch.softmax(scores, -1)
    kept = (mass * keep).sum(-1)
    assert bool((kept >= alpha - 1e-6).all())
    # minimal: dropping the smallest kept cluster falls below alpha
    smallest = torch.where(keep, mass, torch.full_like(mass, 2.0)).min(-1).values
    assert bool((kept - smallest < alpha).all())
    # and the kept clusters are exactly the heaviest ones
    worst_kept = torch.where(keep, mass, torch.full_like(mass, 2.0)).min(-1).values
    best_dropped = torch.where(keep, torch.full_like(mass, -1.0), mass).max(-1).values
    assert bool((worst_kept >= best_dropped).all())
    assert torch.equal(wicsum_bucketed(scores, alpha), keep)


def test_wicsum_alpha_one_keeps_everything_and_rejects_bad_alpha():
    scores = torch.randn(4, 10)
    assert bool(wicsum(scores, 1.0).all()) and bool(wicsum_bucketed(scores, 1.0).all())
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="alpha must be in"):
            wicsum(scores, bad)


def test_predicted_mass_uses_counts_and_mean_keys():
    k, planes = keys(T=256), hyperplanes(64, 12)
    cl = cluster_keys(k, planes, 1)
    q = torch.randn(5, 64)
    s = cluster_scores(q, cl)
    assert torch.allclose(s, q @ cluster_means(cl).T / 8.0 + cl.counts.float().log(), atol=1e-5)


def test_frame_scores_are_the_rows_mean_distribution():
    scores = torch.randn(6, 30)
    agg = frame_scores(scores)
    assert agg.shape == (1, 30)
    assert torch.allclose(agg.exp()[0], torch.softmax(scores, -1).mean(0), atol=1e-6)
    keep = wicsum(agg, 0.8)[0]
    assert float(torch.softmax(scores, -1).mean(0)[keep].sum()) >= 0.8 - 1e-6
