"""Mosaic nested clustering, online assignment and deferred splits (the DRE), and
its two-stage selection (offline analysis, bench/cluster_selection.py)."""

import sys
from pathlib import Path

import torch

from kvreel.dre.mosaic import MosaicIndex, MosaicSession, cosine_kmeans

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from cluster_selection import mosaic_select, mosaic_select_frame, token_mask  # noqa: E402


def session(frames=12, per_frame=32, D=32, seed=0):
    """Frames drawn from 3 'scenes'; tokens of a frame spread around 4 scene topics."""
    g = torch.Generator().manual_seed(seed)
    scenes = torch.randn(3, 4, D, generator=g) * 4
    scene_of = torch.arange(frames) % 3
    keys = []
    for f in range(frames):
        topics = scenes[scene_of[f]]
        keys.append(topics[torch.randint(0, 4, (per_frame,), generator=g)] + 0.2 * torch.randn(per_frame, D,
                                                                                                 generator=g))
    keys = torch.cat(keys)
    frame_of = torch.arange(frames).repeat_interleave(per_frame)
    emb = torch.zeros(frames, D).index_add_(0, frame_of, torch.nn.functional.normalize(keys, dim=-1))
    return keys, frame_of, emb, scene_of


def test_visual_kmeans_recovers_scenes():
    keys, frame_of, emb, scene_of = session()
    labels = cosine_kmeans(emb, 3)
    for s in range(3):   # frames of one scene share one label, different scenes differ
        assert torch.unique(labels[scene_of == s]).numel() == 1
    assert torch.unique(labels).numel() == 3


def test_index_partitions_tokens_and_selection_bounds():
    keys, frame_of, emb, _ = session()
    visual = cosine_kmeans(emb, 3)
    index = MosaicIndex.build(keys, frame_of, visual, per_visual=4)
    tokens = sorted(t for c in index.clusters for t in c.tokens)
    assert tokens == list(range(keys.shape[0]))
    for c in index.clusters:
        assert bool((visual[frame_of[torch.tensor(c.tokens)]] == c.visual).all())
        assert torch.allclose(c.centroid, keys[torch.tensor(c.tokens)].mean(0), atol=1e-4)
    q = keys[:5] + 0.1
    assert bool(mosaic_select(index, q, 1.0).all())
    small = mosaic_select(index, q, 0.3)
    assert bool(small.any(-1).all()) and not bool(small.all())
    per_group = {c.visual for c in index.clusters}
    # the global representatives: every visual group keeps at least one cluster per row
    for v in per_group:
        ids = [i for i, c in enumerate(index.clusters) if c.visual == v]
        assert bool(small[:, ids].any(-1).all())
    mask = token_mask(index, small, keys.shape[0])
    assert mask.shape == (5, keys.shape[0])
    assert bool((mask.sum(-1) == torch.tensor([sum(index.clusters[i].count for i in torch.nonzero(r).flatten())
                                               for r in small])).all())


def test_online_assignment_joins_near_tokens_and_opens_clusters_for_far_ones():
    keys, frame_of, emb, _ = session()
    visual = cosine_kmeans(emb, 3)
    index = MosaicIndex.build(keys, frame_of, visual, per_visual=4)
    before = len(index.clusters)
    near = index.clusters[0].centroid + 0.01
    cid = index.assign(10_000, near, index.clusters[0].visual)
    assert cid == 0 and index.clusters[0].tokens[-1] == 10_000
    far = index.clusters[0].centroid + 100.0
    cid = index.assign(10_001, far, index.clusters[0].visual)
    assert cid == before and len(index.clusters) == before + 1


def test_split_is_deferred_until_applied():
    D = 16
    a, b = torch.zeros(D), torch.zeros(D)
    a[0], b[1] = 1.0, 1.0
    keys = torch.cat([a.expand(20, D), b.expand(20, D)]) + 0.01 * torch.randn(40, D)
    index = MosaicIndex()
    for t in range(40):
        index.assign(t, keys[t], 0)
        if len(index.clusters) > 1:        # the far half opened its own cluster: no split needed
            break
    c = index.clusters[0]
    c.split_pending = True
    for t in range(20, 40):                 # force a mixed cluster
        if t not in c.tokens:
            c.add(t, keys[t], float((keys[t] - c.centroid).norm()))
    n = len(index.clusters)
    ids = index.apply_split(0, keys)
    assert len(ids) == 2 and len(index.clusters) == n + 1
    halves = [set(index.clusters[i].tokens) for i in ids]
    assert all(h <= set(range(20)) or h <= set(range(20, 40)) for h in halves)


def test_frame_selection_serves_every_row():
    keys, frame_of, emb, _ = session()
    index = MosaicIndex.build(keys, frame_of, cosine_kmeans(emb, 3), per_visual=4)
    q = keys[:8] + 0.05
    frame = mosaic_select_frame(index, q, 0.7)
    assert frame.shape == (len(index.clusters),) and bool(frame.any())
    assert bool(mosaic_select_frame(index, q, 1.0).all())


def test_a_session_grows_online_without_reclustering():
    keys, _, _, scene_of = session()
    s = MosaicSession.build(keys[:192], segment=32)           # 6 frames clustered by k-means
    built = [list(c.tokens) for c in s.index.clusters]
    joined = [s.extend(keys[start:start + 16]) for start in range(192, 384, 16)]    # then half-frames arrive
    assert s.num_tokens == 384 and torch.equal(s.keys, keys)
    owner = s.index.owners(384)
    assert torch.equal(torch.cat(joined), owner[192:])         # each token's cluster, as it joined
    assert bool((owner >= 0).all()) and sum(c.count for c in s.index.clusters) == 384
    assert [c.tokens[:len(t)] for c, t in zip(s.index.clusters, built)] == built      # old members stay
    assert len(s.frame_visual) == 12
    for f in range(6, 12):      # a new frame joins the visual group of its scene's earlier frames
        assert s.frame_visual[f] == s.frame_visual[int(torch.nonzero(scene_of[:6] == scene_of[f])[0])]
    for t in range(192, 384):   # and its tokens join clusters of that group
        assert s.index.clusters[int(owner[t])].visual == s.frame_visual[t // 32]


def test_pending_splits_are_applied_only_to_fetched_clusters():
    keys, _, _, _ = session()
    s = MosaicSession.build(keys, segment=32)
    big = max(range(len(s.index.clusters)), key=lambda i: s.index.clusters[i].count)
    other = (big + 1) % len(s.index.clusters)
    s.index.clusters[big].split_pending = s.index.clusters[other].split_pending = True
    members, n = set(s.index.clusters[big].tokens), len(s.index.clusters)
    s.after_fetch(torch.tensor([big]))
    assert len(s.index.clusters) == n + 1
    assert set(s.index.clusters[big].tokens) | set(s.index.clusters[-1].tokens) == members
    assert s.index.clusters[other].split_pending           # not fetched: still deferred
