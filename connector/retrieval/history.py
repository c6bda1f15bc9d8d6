"""The host-memory history of a long session (KVMU, V-Rex's memory unit).

Blocks that left a long request's local window live here, not in vLLM's
paged cache: per layer and KV head, every token's key and value in token
order (``[H, T, D]``, the model's dtype), unpacked once from vLLM's pages as
they arrive (the first block, the attention sinks, included). A step reads
only what it attends to: the runtime writes the chosen tokens into
working-set pages in vLLM's packing (``PagePacking.write_tokens``).

The DRE labels every token after the sink block with its cluster (ReSV's hash
bits or Mosaic's semantic clusters); the history keeps each cluster's key sum
and size per head, so a step can rank clusters by ``q . centroid`` and score
exactly only the tokens of the best ones (``candidates``). Tokens the DRE has
not labelled yet are always candidates."""

from __future__ import annotations

import math

import torch

from kvreel.connector.retrieval.page_packing import PagePacking


def rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[h, index[h]]`` for every head: ``[H, n, D]`` from ``x`` ``[H, T, D]`` and
    ``index`` ``[H, n]``. Row copies (``index_select``) rather than ``torch.gather``
    with an expanded index, which on CPU copies element by element: 25x slower
    for 16 K keys of 64 channels on this machine, and most of a decode step."""
    return torch.stack([x[h].index_select(0, index[h]) for h in range(x.shape[0])])


class LayerHistory:
    """One layer's history of one request."""

    def __init__(self, heads: int, block_size: int, head_dim: int, dtype: torch.dtype, packing: PagePacking):
        self.heads, self.block_size, self.head_dim, self.dtype = heads, block_size, head_dim, dtype
        self.packing = packing
        self.keys = torch.empty(heads, 0, head_dim, dtype=dtype)      # [H, capacity, D], token order
        self.values = torch.empty(heads, 0, head_dim, dtype=dtype)
        self.num_tokens = 0                                           # sink block included
        self.labels = torch.empty(heads, 0, dtype=torch.int64)        # per token after the sink; -1: unlabelled
        self.sums = torch.zeros(heads, 0, head_dim)                   # per cluster: key sum (float32)
        self.counts = torch.zeros(heads, 0)                           # and size

    @property
    def nbytes(self) -> int:
        return 2 * self.heads * self.num_tokens * self.head_dim * self.keys.element_size()

    def append(self, pages: torch.Tensor, first_block: int) -> torch.Tensor:
        """Append cache pages ``[n, H, 2 bs, D]`` of blocks ``first_block...``; the
        keys of their tokens after the sink block ``[H, m, D]`` (float32, for the DRE)."""
        if first_block * self.block_size != self.num_tokens:
            raise ValueError(f"history holds {self.num_tokens} tokens, got blocks from {first_block}")
        k, v = self.packing.unpack(pages)                                 # [n bs, H, D]
        n = k.shape[0]
        self._reserve(self.num_tokens + n)
        self.keys[:, self.num_tokens:self.num_tokens + n] = k.transpose(0, 1)
        self.values[:, self.num_tokens:self.num_tokens + n] = v.transpose(0, 1)
        self.num_tokens += n
        self.labels = torch.cat([self.labels, torch.full((self.heads, n), -1, dtype=torch.int64)], 1)
        if first_block == 0:
            self.labels = self.labels[:, self.block_size:]
            k = k[self.block_size:]
        return k.transpose(0, 1).float()

    def _reserve(self, tokens: int) -> None:
        cap = self.keys.shape[1]
        if tokens <= cap:
            return
        new_cap = max(tokens, 2 * cap, 16 * self.block_size)
        for name in ("keys", "values"):
            grown = torch.empty(self.heads, new_cap, self.head_dim, dtype=self.dtype)
            grown[:, :self.num_tokens] = getattr(self, name)[:, :self.num_tokens]
            setattr(self, name, grown)

    def dre_keys(self) -> torch.Tensor:
        """Every key after the sink block ``[H, T - bs, D]`` (float32): to cluster anew."""
        return self.keys[:, self.block_size:self.num_tokens].float()

    def set_labels(self, first_token: int, labels: torch.Tensor) -> None:
        """Cluster labels ``[H, n]`` of history tokens ``first_token...`` (token ids,
        sink block excluded); the clusters' key sums and sizes follow."""
        start = first_token - self.block_size
        end = start + labels.shape[1]
        relabel = bool((self.labels[:, start:end] >= 0).any())
        self.labels[:, start:end] = labels
        clusters = int(labels.max()) + 1 if labels.numel() else 0
        if clusters > self.sums.shape[1]:
            grow = clusters - self.sums.shape[1]
            self.sums = torch.cat([self.sums, torch.zeros(self.heads, grow, self.head_dim)], 1)
            self.counts = torch.cat([self.counts, torch.zeros(self.heads, grow)], 1)
        if relabel:                                   # Mosaic split clusters: every sum anew
            self.sums.zero_()
            self.counts.zero_()
            start, end = 0, self.num_tokens - self.block_size
        keys = self.keys[:, self.block_size + start:self.block_size + end].float()
        for h in range(self.heads):
            lab = self.labels[h, start:end]
            ok = lab >= 0
            self.sums[h].index_add_(0, lab[ok], keys[h][ok])
            self.counts[h].index_add_(0, lab[ok], torch.ones(int(ok.sum())))

    def candidates(self, queries: torch.Tensor, count: int) -> torch.Tensor:
        """Per head, ``count`` history tokens after the sink block ``[H, count]``
        (token ids) whose clusters the query rows ``[H, R, D]`` rank best: every
        row spreads its mass over the clusters (softmax of ``q . centroid / sqrt D
        + log size``), and a token ranks by the largest per-token share any row
        gives its cluster. Every unlabelled token is a candidate (more than
        ``count`` of them: all of them)."""
        scale = self.head_dim ** -0.5
        live = self.counts > 0
        means = self.sums / self.counts.clamp_min(1).unsqueeze(-1)
        scores = torch.bmm(queries.float(), means.transpose(1, 2)) * scale + self.counts.clamp_min(1).log().unsqueeze(1)
        share = torch.softmax(scores.masked_fill(~live.unsqueeze(1), -math.inf), dim=-1)
        per_token = (share.amax(1) / self.counts.clamp_min(1))                         # [H, C]
        labels = self.labels[:, :self.num_tokens - self.block_size]
        count = min(labels.shape[1], max(count, int((labels < 0).sum(1).max())))      # every unlabelled one
        if not per_token.shape[1]:
            per_token = torch.zeros(self.heads, 1)
        rank = torch.where(labels >= 0, per_token.gather(1, labels.clamp_min(0)), math.inf)
        return torch.topk(rank, count, dim=1, sorted=False).indices + self.block_size      # a set: unsorted


class RequestHistory:
    """Every layer's history of one request; blocks ``[0, num_blocks)`` are held."""

    def __init__(self, layers: int, heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 packing: PagePacking):
        self.layers = [LayerHistory(heads, block_size, head_dim, dtype, packing) for _ in range(layers)]
        self.num_blocks = 0
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
