"""KVMU layout (V-Rex): the host tier keeps each cluster's tokens contiguous,
so fetching a selected cluster is one slice copy, not one copy per token.

``ClusterLayout`` stores one (layer, KV head)'s offloaded K and V reordered by
cluster (stable: tokens keep their order inside a cluster), with each
cluster's row range and the original token id of every row. ``fetch`` moves
the selected clusters with one copy per run of adjacent clusters into one
destination (pinned host memory, so a GPU copy is a single DMA per run);
``fetch_tokens`` is the per-token layout's gather, the baseline.
"""

from __future__ import annotations

import torch


class ClusterLayout:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, labels: torch.Tensor, pin: bool = False):
        """``keys``/``values`` [T, D] in token order, ``labels`` [T] cluster ids 0..C-1."""
        if keys.shape != values.shape or keys.dim() != 2 or labels.shape != keys.shape[:1]:
            raise ValueError(f"want keys/values [T, D] and labels [T], got {tuple(keys.shape)}, "
                             f"{tuple(values.shape)}, {tuple(labels.shape)}")
        order = torch.argsort(labels, stable=True)
        counts = torch.bincount(labels, minlength=int(labels.max()) + 1 if len(labels) else 0)
        self.starts = torch.cumsum(counts, 0) - counts            # first row of each cluster
        self.counts = counts
        self.token_ids = order                                    # row -> token id
        kv = torch.stack([keys[order], values[order]], dim=1)     # [T, 2, D], a cluster's rows adjacent
        self.kv = kv.pin_memory() if pin else kv

    def runs(self, clusters: torch.Tensor) -> list[tuple[int, int]]:
        """(first row, rows) of each run of adjacent selected clusters."""
        c = torch.unique(clusters)
        c = c[self.counts[c] > 0]
        if not len(c):
            return []
        starts, ends = self.starts[c], self.starts[c] + self.counts[c]
        new_run = torch.ones(len(c), dtype=torch.bool)
        new_run[1:] = starts[1:] != ends[:-1]                     # not adjacent to the previous cluster
        first = torch.nonzero(new_run).flatten()
        last = torch.cat([first[1:] - 1, torch.tensor([len(c) - 1])])
        return list(zip(starts[first].tolist(), (ends[last] - starts[first]).tolist()))

    def fetch(self, clusters: torch.Tensor, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, kv [N, 2, D]) of the selected clusters: one copy per run."""
        runs = self.runs(clusters)
        n = sum(r for _, r in runs)
        out = torch.empty((n, 2, self.kv.shape[2]), dtype=self.kv.dtype, device=device)
        at = 0
        for start, rows in runs:
            out[at:at + rows].copy_(self.kv[start:start + rows], non_blocking=True)
            at += rows
        ids = torch.cat([self.token_ids[s:s + r] for s, r in runs]) if runs else torch.empty(0, dtype=torch.long)
        return ids, out


def fetch_tokens(keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """The per-token layout's fetch of the same tokens: a gather, then a copy."""
    return torch.stack([keys[token_ids], values[token_ids]], dim=1).to(device)
