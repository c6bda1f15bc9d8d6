"""Mosaic: nested visual -> semantic clustering of a long session's KV.

* Visual level: frames (or text segments standing in for them) are grouped by
  cosine k-means over frame embeddings.
* Semantic level, per layer and KV head: inside each visual cluster the keys,
  centred on the history's mean key (a head's keys share a large offset that
  would swamp cosines), are grouped by cosine k-means; every semantic cluster
  keeps its centroid, size and running distance statistics (the centroid index).
* Selection: a served step ranks the clusters in the worker with its own
  queries (``kvreel.connector.retrieval.history``); the paper's two-stage
  selection (visual groups, then their semantic clusters, WiCSum, a
  representative per group) is offline analysis in ``bench/cluster_selection.py``.
* Online: a new token joins its nearest centroid when its distance is within
  the cluster's size-adaptive threshold (mean + k x std of member distances,
  k shrinking as the cluster grows); otherwise it opens a cluster. A cluster
  whose spread grows too large is marked for a split that is applied only when
  the cluster is fetched anyway (its keys are on hand then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvreel.dre.tensors import grown


def cosine_kmeans(x: torch.Tensor, k: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Labels [N] of a spherical k-means over rows of ``x`` (k-means++ seeding)."""
    n = x.shape[0]
    k = max(1, min(k, n))
    xn = torch.nn.functional.normalize(x.float(), dim=-1)
    g = torch.Generator().manual_seed(seed)
    centers = [int(torch.randint(n, (1,), generator=g))]
    for _ in range(1, k):
        sim = (xn @ xn[centers].T).max(-1).values
        w = (1 - sim).clamp_min(0) + 1e-9
        centers.append(int(torch.multinomial(w, 1, generator=g)))
    c = xn[centers]
    labels = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        new = (xn @ c.T).argmax(-1)
        if torch.equal(new, labels):
            break
        labels = new
        for j in range(k):
            members = xn[labels == j]
            if members.numel():
                c[j] = torch.nn.functional.normalize(members.mean(0), dim=-1)
    return labels


@dataclass
class SemanticCluster:
    visual: int
    tokens: list[int]
    key_sum: torch.Tensor
    dist_mean: float = 0.0      # Welford statistics of member distances to the centroid
    dist_m2: float = 0.0
    split_pending: bool = False

    @property
    def count(self) -> int:
        return len(self.tokens)

    @property
    def centroid(self) -> torch.Tensor:
        return self.key_sum / self.count

    def threshold(self, base_k: float) -> float:
        """Size-adaptive: small clusters accept generously, large ones tighten."""
        std = math.sqrt(self.dist_m2 / self.count) if self.count > 1 else 0.0
        k = base_k / math.sqrt(math.log2(self.count + 1))
        return self.dist_mean + k * std if self.count > 2 else float("inf")

    def add(self, token: int, key: torch.Tensor, dist: float) -> None:
        self.tokens.append(token)
        self.key_sum += key
        delta = dist - self.dist_mean
        self.dist_mean += delta / self.count
        self.dist_m2 += delta * (dist - self.dist_mean)


@dataclass
class MosaicIndex:
    """One (layer, KV head)'s centroid index over a session's history."""
    clusters: list[SemanticCluster] = field(default_factory=list)
    # A session's index is built on its first history block and grows by online
    # assignment, so this threshold sets the clusters' size: smaller clusters,
    # closer predictions, a larger table. 0.5 is the setting measured as served in
    # bench/retrieval_served.py (>= 97 % top-1 on SmolLM2-135M at a working set of
    # 1/3 of the history; 3.0, with a few hundred clusters per head, fell short).
    base_k: float = 0.5
    split_std: float = 0.5
    # A token beyond its nearest cluster's threshold opens a cluster only while the
    # clusters average at least this many tokens; past that it joins the nearest
    # (its key then widens the cluster's bounds, which the worker ranks by too).
    # Unbounded, about 40 % of a long prompt's new tokens opened a cluster
    # (SmolLM2-135M, YaRN x4, Python: 368 clusters per head from 16 K tokens, 1 200
    # after 2 K more), so the index grew like the history and narrowed nothing.
    min_mean_size: int = 32
    tokens: int = 0
    center: torch.Tensor | float = 0.0      # subtracted from keys before k-means (the history's mean key)
    # every cluster's centroid and visual group, in rows [:len(clusters)] of room that grows
    _cents: torch.Tensor | None = field(default=None, repr=False)
    _visuals: torch.Tensor | None = field(default=None, repr=False)
    _rows: int = field(default=0, repr=False)

    @classmethod
    def build(cls, keys: torch.Tensor, frame_of: torch.Tensor, visual_labels: torch.Tensor,
              per_visual: int, seed: int = 0) -> "MosaicIndex":
        """``frame_of[t]``: frame of token t; ``visual_labels[f]``: visual cluster of frame f."""
        index = cls(center=keys.float().mean(0))
        vis_of_token = visual_labels[frame_of]
        for v in torch.unique(vis_of_token).tolist():
            toks = torch.nonzero(vis_of_token == v).flatten()
            sub = cosine_kmeans(keys[toks].float() - index.center, per_visual, seed=seed)
            for j in torch.unique(sub).tolist():
                members = toks[sub == j]
                c = SemanticCluster(v, [], torch.zeros(keys.shape[1]))
                centroid = keys[members].float().mean(0)
                for t in members.tolist():
                    c.add(t, keys[t].float(), float((keys[t].float() - centroid).norm()))
                index.clusters.append(c)
        index.tokens = keys.shape[0]
        return index

    @property
    def nbytes(self) -> int:
        """Its tensors, and its clusters' token lists: a list slot and an int object
        a token in CPython (36 bytes; counted, not walked, as every reply asks)."""
        tensors = [c.key_sum for c in self.clusters]
        tensors += [t for t in (self._cents, self._visuals, self.center) if isinstance(t, torch.Tensor)]
        return sum(t.nbytes for t in tensors) + 36 * sum(c.count for c in self.clusters)

    def assign(self, token: int, key: torch.Tensor, visual: int) -> int:
        """Online insertion of one new token; the cluster id it joined."""
        key = key.float()
        self.tokens += 1
        cents, visuals = self.centroid_table()
        same = torch.nonzero(visuals == visual).flatten()
        if same.numel():
            d = (cents[same] - key).norm(dim=-1)
            j = int(d.argmin())
            cid = int(same[j])
            c = self.clusters[cid]
            full = len(self.clusters) * self.min_mean_size >= self.tokens
            if full or float(d[j]) <= c.threshold(self.base_k):
                c.add(token, key, float(d[j]))
                cents[cid] = c.centroid
                std = math.sqrt(c.dist_m2 / c.count) if c.count > 1 else 0.0
                c.split_pending = c.count > 8 and std > self.split_std * max(c.dist_mean, 1e-6)
                return cid
        self.clusters.append(SemanticCluster(visual, [token], key.clone()))
        C = len(self.clusters)
        if C > self._cents.shape[0]:
            size = C + C // 4
            self._cents = grown(self._cents.view(-1, key.shape[0]), 0, size, C - 1)
            self._visuals = grown(self._visuals, 0, size, C - 1)
        self._cents[C - 1], self._visuals[C - 1], self._rows = key, visual, C
        return C - 1

    def centroid_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cluster's centroid ``[C, D]`` and visual group ``[C]``, kept in step
        with ``clusters`` (rebuilt after a split), so that assigning a token is a
        few tensor ops, not a Python pass over thousands of clusters."""
        C = len(self.clusters)
        if self._cents is None or self._rows != C:
            self._cents = torch.stack([c.centroid for c in self.clusters]) if self.clusters else torch.empty(0, 0)
            self._visuals = torch.tensor([c.visual for c in self.clusters], dtype=torch.long)
            self._rows = C
        return self._cents[:C], self._visuals[:C]

    def apply_split(self, cid: int, keys: torch.Tensor) -> list[int]:
        """Split a pending cluster in two (its keys are at hand because it was
        just fetched); the ids of the resulting clusters."""
        c = self.clusters[cid]
        if not c.split_pending or c.count < 4:
            return [cid]
        toks = torch.tensor(c.tokens)
        labels = cosine_kmeans(keys[toks].float() - self.center, 2)
        parts = []
        for j in (0, 1):
            members = toks[labels == j].tolist()
            if not members:
                continue
            new = SemanticCluster(c.visual, [], torch.zeros_like(c.key_sum))
            cent = keys[members].float().mean(0)
            for t in members:
                new.add(t, keys[t].float(), float((keys[t].float() - cent).norm()))
            parts.append(new)
        if len(parts) < 2:
            c.split_pending = False
            return [cid]
        self.clusters[cid] = parts[0]
        self.clusters.append(parts[1])
        self._cents = None
        return [cid, len(self.clusters) - 1]

    def owners(self, n_tokens: int) -> torch.Tensor:
        """[n_tokens]: the cluster of each token (-1: in none)."""
        owner = torch.full((n_tokens,), -1, dtype=torch.long)
        for i, c in enumerate(self.clusters):
            owner[torch.tensor(c.tokens, dtype=torch.long)] = i
        return owner



@dataclass
class MosaicSession:
    """Mosaic over one head's growing history, every ``segment`` tokens a frame
    (text segments standing in for video frames). Built once by k-means (frames
    grouped by their mean key, keys clustered inside each group), then extended
    online: a new frame joins the visual group nearest to its embedding, a new
    token the nearest semantic cluster of that group or a new one. Splits marked
    pending are applied when their cluster is fetched (``after_fetch``), since
    its keys are at hand then; the session keeps the keys for that."""
    index: MosaicIndex
    room: torch.Tensor              # [capacity, D] float32: the history's keys, then room to grow into
    segment: int
    visual_sums: torch.Tensor       # [V, D] sums of member frames' unit embeddings
    frame_visual: list[int]
    num_tokens: int

    @classmethod
    def build(cls, keys: torch.Tensor, segment: int, per_visual: int = 16) -> "MosaicSession":
        keys = keys.float()
        frame_of = torch.arange(keys.shape[0]) // segment
        frames = int(frame_of[-1]) + 1 if len(frame_of) else 0
        embeddings = torch.zeros(frames, keys.shape[1]).index_add_(0, frame_of, keys)
        visual = cosine_kmeans(embeddings, max(1, round(math.sqrt(frames))))
        unit = torch.nn.functional.normalize(embeddings, dim=-1)
        sums = torch.zeros(int(visual.max()) + 1 if frames else 0, keys.shape[1]).index_add_(0, visual, unit)
        return cls(MosaicIndex.build(keys, frame_of, visual, per_visual), keys, segment, sums, visual.tolist(),
                   keys.shape[0])

    @property
    def keys(self) -> torch.Tensor:
        """The history's keys ``[T, D]`` (float32)."""
        return self.room[:self.num_tokens]

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.room.nbytes + self.visual_sums.nbytes + 8 * len(self.frame_visual)

    def extend(self, keys: torch.Tensor) -> torch.Tensor:
        """Appends the next tokens' keys (online assignment; no re-clustering); the
        cluster each joined (what ``index.owners`` would say of them, without its
        pass over every token)."""
        keys = keys.float()
        start = self.num_tokens
        if start + keys.shape[0] > self.room.shape[0]:            # grows by a quarter, as a history's room
            self.room = grown(self.room, 0, start + max(keys.shape[0], start // 4), start)
        self.room[start:start + keys.shape[0]] = keys
        self.num_tokens += keys.shape[0]
        frames = torch.arange(start, self.num_tokens) // self.segment
        joined = []
        for i, f in enumerate(frames.tolist()):
            if f >= len(self.frame_visual):
                self.frame_visual.append(self._visual_of(keys[frames == f].sum(0)))
            joined.append(self.index.assign(start + i, keys[i], self.frame_visual[f]))
        return torch.tensor(joined, dtype=torch.long)

    def _visual_of(self, embedding: torch.Tensor) -> int:
        unit = torch.nn.functional.normalize(embedding, dim=-1)
        if self.visual_sums.shape[0] == 0:
            self.visual_sums = unit.unsqueeze(0)
            return 0
        v = int((torch.nn.functional.normalize(self.visual_sums, dim=-1) @ unit).argmax())
        self.visual_sums[v] += unit
        return v

    def after_fetch(self, cluster_ids: torch.Tensor) -> bool:
        """Applies the pending splits of clusters just fetched; whether any split."""
        before = len(self.index.clusters)
        for cid in cluster_ids.tolist():
            if self.index.clusters[cid].split_pending:
                self.index.apply_split(cid, self.keys)
        return len(self.index.clusters) != before
