"""How a step ranks a history's clusters and takes their tokens: the cluster
index (tokens grouped by the DRE's labels) and the folds and merges of
``LayerHistory.candidates``."""

from __future__ import annotations

import torch


class ClusterIndex:
    """Per head, the history's tokens grouped by cluster, as the DRE's labels
    stood when it was built: ``order`` lists the unlabelled tokens, then
    cluster 0's, cluster 1's... (positions after the sink block), and each
    cluster's run in it. A step takes the tokens of its best clusters in
    O(clusters + candidates), where ranking every token by its cluster costs a
    pass (and a top-k) over the whole history."""

    def __init__(self, labels: torch.Tensor):
        self.built = labels.shape[1]                                       # tokens it covers
        self.order = torch.argsort(labels, dim=1, stable=True)
        self.unlabelled = (labels < 0).sum(1)                              # [H]: the first of ``order``
        clusters = int(labels.max()) + 1 if labels.numel() else 0
        self.sizes = torch.zeros(labels.shape[0], max(clusters, 1), dtype=torch.int64).scatter_add_(
            1, labels.clamp_min(0), (labels >= 0).long())[:, :clusters]
        self.starts = self.unlabelled.unsqueeze(1) + self.sizes.cumsum(1) - self.sizes

    def best(self, h: int, ranked: torch.Tensor, need: int) -> torch.Tensor:
        """The first ``need`` tokens of head ``h``'s clusters taken in the order ``ranked``."""
        sizes = self.sizes[h, ranked]
        ends = sizes.cumsum(0)
        taken = int(torch.searchsorted(ends, need)) + 1
        run = torch.repeat_interleave(torch.arange(taken), torch.minimum(ends[:taken], torch.tensor(need))
                                      - (ends[:taken] - sizes[:taken]))
        within = torch.arange(need) - (ends - sizes)[run]
        return self.order[h, self.starts[h, ranked[:taken]][run] + within]


def fold_log_shares(best: torch.Tensor, logits: torch.Tensor) -> None:
    """``best`` ``[H, C]`` raised to the largest log softmax share any row of
    ``logits`` ``[H, r, C]`` gives each column (``logits`` overwritten)."""
    torch.log_softmax(logits, -1, out=logits)        # in place: torch's logsumexp takes 4x as long on CPU
    torch.maximum(best, logits.amax(1), out=best)


def merged(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Per row, two orders ``[H, C]`` of the same ids merged: each id at the better of
    its two places (ties: ``first``'s), so both orders' leaders come first, alternately."""
    place = torch.empty_like(first)
    rows = torch.arange(first.shape[1]).expand_as(first)
    at_first = place.scatter(1, first, rows * 2)
    at_second = place.scatter(1, second, rows * 2 + 1)
    return torch.argsort(torch.minimum(at_first, at_second), dim=1)
