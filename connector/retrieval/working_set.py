"""A long request's working set for one layer: the pages vLLM's kernel reads.

The runtime keeps one per (request, layer) in a slot of the layer's buffer;
here is what it holds and how a new choice of history tokens gets written into
it: in vLLM's page packing (``PagePacking.write_tokens``), only where a page
position must change."""

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
        holds them, so the kernel sums in the same order); only positions that
        hold another token are written."""
        n = lh.num_tokens
        want = torch.arange(n)
        heads, slots = torch.nonzero(self.held[:, :n] != want, as_tuple=True)
        self._write(lh, heads, slots, slots)
        self.held[:, :n] = want
        self.held[:, n:] = -1
        self.m = n // lh.block_size

    def hold(self, lh: LayerHistory, want: torch.Tensor) -> None:
        """The tokens ``want`` ``[H, N]`` (N a whole number of pages) in the first
        pages, in any order: a token that stays keeps its place (a step's choice
        mostly repeats the last one), the others are written where they go."""
        H, n = want.shape
        held = self.held[:, :n]
        # membership by lookup in a mask over (head, token) ids: torch.isin sorts both sides
        at = torch.arange(H).unsqueeze(1) * lh.num_tokens
        wanted = torch.zeros(H * lh.num_tokens, dtype=torch.bool)
        wanted[want + at] = True
        stays = (held >= 0) & wanted[held.clamp_min(0) + at]
        kept = torch.zeros_like(wanted)
        kept[(held + at)[stays]] = True
        heads, slots = torch.nonzero(~stays, as_tuple=True)           # per head, as many as its new tokens
        tokens = want[~kept[want + at]]
        self._write(lh, heads, slots, tokens)
        self.held[heads, slots] = tokens
        self.held[:, n:] = -1
        self.m = n // lh.block_size


    def _write(self, lh: LayerHistory, heads: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        if heads.numel():
            bs = lh.block_size
            rows = heads * lh.keys.shape[1] + tokens          # row copies: see history.rows_of
            lh.packing.write_tokens(self.buffer, slots // bs, heads, slots % bs,
                                    lh.keys.view(-1, lh.head_dim).index_select(0, rows),
                                    lh.values.view(-1, lh.head_dim).index_select(0, rows))

def write_history_pages(pages: torch.Tensor, lh: LayerHistory, tokens: torch.Tensor) -> None:
    """History tokens ``tokens`` ``[H, N]`` (per head; N a whole number of pages)
    into the first ``N / bs`` of ``pages``, position by position, with vLLM's own
    packing op (a whole page run: no per-token scatter)."""
    H, n = tokens.shape
    rows = (tokens + torch.arange(H).unsqueeze(1) * lh.keys.shape[1]).T.flatten()     # [n, H] order
    k = lh.keys.view(-1, lh.head_dim).index_select(0, rows).view(n, H, -1)
    v = lh.values.view(-1, lh.head_dim).index_select(0, rows).view(n, H, -1)
    lh.packing.pack(k, v, pages, torch.arange(n))
