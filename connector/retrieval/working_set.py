"""A long request's working set for one layer: the pages vLLM's kernel reads.

The runtime keeps one per (request, layer) in a slot of the layer's buffer;
here is what it holds and how a new choice of history tokens gets written into
it: whole page runs in vLLM's page packing (``write_history_pages``)."""

from __future__ import annotations

import dataclasses

import torch

from kvreel.connector.retrieval.history import LayerHistory


@dataclasses.dataclass
class WorkingSet:
    """``m`` pages of history tokens (the sink block's among them), then room for
    the request's resident blocks. ``held`` names the history token at each
    page position, per head (-1: none)."""
    buffer: torch.Tensor                  # the slot's pages [pages, H, 2 bs, D] (a view of the layer's buffer)
    slot: int
    held: torch.Tensor                    # [H, budget pages * bs] token ids
    m: int = 0

    def hold_in_order(self, lh: LayerHistory) -> None:
        """Every history token, token t at page position t (as vLLM's own cache
        holds them, so the kernel sums in the same order); pages from the first
        position that holds another token on are written (the history grows at
        its end, so mostly only its newest pages)."""
        n, bs = lh.num_tokens, lh.block_size
        want = torch.arange(n)
        differs = (self.held[:, :n] != want).any(0).nonzero()
        if differs.numel():
            first = int(differs[0]) // bs * bs
            write_history_pages(self.buffer[first // bs:], lh, want[first:].expand(lh.heads, -1))
        self.held[:, :n] = want
        self.held[:, n:] = -1
        self.m = n // bs

    def hold(self, lh: LayerHistory, want: torch.Tensor) -> None:
        """The tokens ``want`` ``[H, N]`` (N a whole number of pages) in the first
        pages, in that order, written whole with vLLM's packing op: its cost is
        bounded by the budget whatever changed, where scattering only the changed
        tokens costs about 2 us each (16 K history, 2 048 tokens per head on an
        AVX2 core: 0.33 ms for all of them, 4.5 ms to scatter the half that an
        unrelated query changes; served decoding, where few change, timed alike)."""
        n = want.shape[1]
        write_history_pages(self.buffer, lh, want)
        self.held[:, :n] = want
        self.held[:, n:] = -1
        self.m = n // lh.block_size


def write_history_pages(pages: torch.Tensor, lh: LayerHistory, tokens: torch.Tensor) -> None:
    """History tokens ``tokens`` ``[H, N]`` (per head; N a whole number of pages)
    into the first ``N / bs`` of ``pages``, position by position, with vLLM's own
    packing op (a whole page run: no per-token scatter)."""
    H, n = tokens.shape
    rows = (tokens + torch.arange(H).unsqueeze(1) * lh.keys.shape[1]).T.flatten()     # [n, H] order
    k = lh.keys.view(-1, lh.head_dim).index_select(0, rows).view(n, H, -1).to(lh.dtype)
    v = lh.values.view(-1, lh.head_dim).index_select(0, rows).view(n, H, -1)
    lh.packing.pack(k, v, pages, torch.arange(n))
