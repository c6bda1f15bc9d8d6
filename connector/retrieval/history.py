"""The host-memory history of a long session (KVMU, V-Rex's memory unit).

Blocks that left a long request's local window live here, not in vLLM's
paged cache. Per layer and KV head the history is a row of *page slabs*: one
head's share of a cache page (``[2 * block_size, head_dim]``, packed exactly
as vLLM's CPU cache packs it), so moving a slab into the working set is one
copy and needs no repacking. New blocks are appended in token order; once the
DRE has labelled the tokens with their clusters, a head's slabs are rebuilt
in cluster order (``compact``), so the tokens of a cluster sit in few
consecutive slabs and a selected cluster moves in few copies. The first block
(the attention sinks) is kept apart, in token order, for every head.

``LayerHistory.tokens`` records which tokens each slab holds, so a predicted
per-token attention mass turns into a per-slab mass for the selection."""

from __future__ import annotations

import torch

from kvreel.connector.retrieval.page_packing import PagePacking


class LayerHistory:
    """One layer's history of one request."""

    def __init__(self, heads: int, block_size: int, head_dim: int, dtype: torch.dtype, packing: PagePacking):
        self.heads, self.block_size, self.head_dim, self.dtype = heads, block_size, head_dim, dtype
        self.packing = packing
        self.sink: torch.Tensor | None = None                     # [H, 2 bs, D]
        self.slabs = torch.empty(heads, 0, 2 * block_size, head_dim, dtype=dtype)
        self.tokens = torch.empty(heads, 0, block_size, dtype=torch.int64)
        self.n_slabs = 0
        self.labels = torch.empty(heads, 0, dtype=torch.int64)     # per history token (-1: not yet labelled)
        self.sorted_slabs = 0                                      # slabs [0, sorted) are in cluster order
        self.version = 0                                           # bumped when slabs move

    @property
    def num_tokens(self) -> int:
        """History tokens after the sink block."""
        return self.n_slabs * self.block_size

    @property
    def nbytes(self) -> int:
        sink = self.sink.numel() * self.sink.element_size() if self.sink is not None else 0
        return sink + self.n_slabs * self.heads * 2 * self.block_size * self.head_dim * self.slabs.element_size()

    def append(self, pages: torch.Tensor, first_block: int) -> torch.Tensor:
        """Append cache pages ``[n, H, 2 bs, D]`` of blocks ``first_block...``;
        their keys ``[H, n * bs, D]`` (float32), which the DRE clusters."""
        if first_block == 0:
            self.sink = pages[0].clone()
            pages = pages[1:]
            first_block = 1
        n = pages.shape[0]
        if n == 0:
            return torch.empty(self.heads, 0, self.head_dim)
        self._reserve(self.n_slabs + n)
        self.slabs[:, self.n_slabs:self.n_slabs + n] = pages.transpose(0, 1)
        start = first_block * self.block_size
        ids = torch.arange(start, start + n * self.block_size).view(n, self.block_size)
        self.tokens[:, self.n_slabs:self.n_slabs + n] = ids
        self.n_slabs += n
        self.labels = torch.cat([self.labels, torch.full((self.heads, n * self.block_size), -1, dtype=torch.int64)], 1)
        keys, _ = self.packing.unpack(pages)                        # [n bs, H, D]
        return keys.transpose(0, 1).float()

    def _reserve(self, slabs: int) -> None:
        cap = self.slabs.shape[1]
        if slabs <= cap:
            return
        new_cap = max(slabs, 2 * cap, 16)
        grown = torch.empty(self.heads, new_cap, 2 * self.block_size, self.head_dim, dtype=self.dtype)
        grown[:, :self.n_slabs] = self.slabs[:, :self.n_slabs]
        tokens = torch.empty(self.heads, new_cap, self.block_size, dtype=torch.int64)
        tokens[:, :self.n_slabs] = self.tokens[:, :self.n_slabs]
        self.slabs, self.tokens = grown, tokens

    def keys(self) -> torch.Tensor:
        """Every history token's key ``[H, T, D]`` in token order (to cluster anew)."""
        out = torch.empty(self.heads, self.num_tokens, self.head_dim)
        for h in range(self.heads):
            k, _ = self.packing.unpack(self.slabs[h, :self.n_slabs].unsqueeze(1))
            out[h, self.tokens[h, :self.n_slabs].flatten() - self.block_size] = k[:, 0].float()
        return out

    def set_labels(self, first_token: int, labels: torch.Tensor) -> None:
        """Cluster labels ``[H, n]`` of history tokens ``first_token...`` (token ids, sink block excluded)."""
        start = first_token - self.block_size
        self.labels[:, start:start + labels.shape[1]] = labels

    def unsorted_share(self) -> float:
        return 1.0 - self.sorted_slabs / self.n_slabs if self.n_slabs else 0.0

    def compact(self) -> None:
        """Rebuild every head's slabs in cluster order (tokens of a cluster
        consecutive, in token order inside it; unlabelled tokens last)."""
        if not self.n_slabs:
            return
        bs = self.block_size
        for h in range(self.heads):
            k, v = self.packing.unpack(self.slabs[h, :self.n_slabs].unsqueeze(1))     # [T, 1, D]
            tokens = self.tokens[h, :self.n_slabs].flatten()
            labels = self.labels[h, tokens - bs]
            labels = torch.where(labels < 0, torch.iinfo(torch.int64).max, labels)
            order = torch.argsort(tokens)                                           # token order first...
            order = order[torch.sort(labels[order], stable=True).indices]          # ...then by cluster
            slabs = torch.empty(self.n_slabs, 1, 2 * bs, self.head_dim, dtype=self.dtype)
            self.packing.pack(k[order], v[order], slabs, torch.arange(len(order)))
            self.slabs[h, :self.n_slabs] = slabs[:, 0]
            self.tokens[h, :self.n_slabs] = tokens[order].view(self.n_slabs, bs)
        self.sorted_slabs = self.n_slabs
        self.version += 1

    def slab_mass(self, token_mass: torch.Tensor) -> torch.Tensor:
        """Per-token predicted mass ``[H, T]`` (history tokens, sink excluded) ->
        per-slab mass ``[H, n_slabs]``."""
        index = self.tokens[:, :self.n_slabs].reshape(self.heads, -1) - self.block_size
        return token_mass.gather(1, index).view(self.heads, self.n_slabs, self.block_size).sum(-1)


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
