"""A long request's working set for one layer: the pages vLLM's kernel reads.

The runtime keeps one per (request, layer) in a slot of the layer's buffer;
here is what it holds and how a new choice gets written into it: whole
history blocks as page copies, chosen tokens as page runs in vLLM's packing
(``write_history_pages``)."""

from __future__ import annotations

import torch

from kvreel.connector.retrieval.history import LayerHistory
from kvreel.connector.retrieval.scoring import block_tokens


class SlotBuffers:
    """Every layer's working-set buffer ``[slots x slot_pages, H, 2 bs, D]``: one
    slot per long request, the same in every layer; all of them grow (doubling)
    when every slot is taken, and the working sets' views move over."""

    def __init__(self, layers: int, page_shape: tuple[int, ...], dtype: torch.dtype, slot_pages: int):
        self.layers, self.page_shape, self.dtype, self.slot_pages = layers, page_shape, dtype, slot_pages
        self.buffers: dict[int, torch.Tensor] = {}
        self._slots: dict[str, int] = {}

    def slot(self, req_id: str, working: dict[tuple[str, int], "WorkingSet"]) -> int:
        """The request's slot (a new one taken, and the buffers grown, when it has
        none); ``working``: every (request, layer)'s working set, re-viewed on growth."""
        slot = self._slots.get(req_id)
        if slot is None:
            taken = set(self._slots.values())
            slot = next(i for i in range(len(taken) + 1) if i not in taken)
            self._slots[req_id] = slot
            need = (slot + 1) * self.slot_pages
            for layer in range(self.layers):
                old = self.buffers.get(layer)
                if old is None or old.shape[0] < need:
                    grown = torch.empty(max(need, 2 * (0 if old is None else old.shape[0])), *self.page_shape,
                                        dtype=self.dtype)
                    if old is not None:
                        grown[:old.shape[0]] = old
                    self.buffers[layer] = grown
                    for (_, lay), ws in working.items():
                        if lay == layer:
                            ws.buffer = self.view(layer, ws.slot)
        return slot

    def view(self, layer: int, slot: int) -> torch.Tensor:
        return self.buffers[layer][slot * self.slot_pages:(slot + 1) * self.slot_pages]

    def release(self, req_id: str) -> None:
        self._slots.pop(req_id, None)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


class WorkingSet:
    """``m`` pages of history tokens (the sink block's among them), then room for
    the request's resident blocks. ``held`` names the history token at each
    page position, per head (-1: none)."""

    def __init__(self, buffer: torch.Tensor, slot: int, heads: int, positions: int):
        self.buffer = buffer              # the slot's pages [pages, H, 2 bs, D] (a view of the layer's buffer)
        self.slot = slot
        self.m = 0
        self._held = torch.full((heads, positions), -1, dtype=torch.int64)
        self._blocks: tuple[torch.Tensor, int] | None = None     # (blocks [H, m], bs) not yet written to _held
        self._head_rows = torch.arange(heads).unsqueeze(1)

    @property
    def held(self) -> torch.Tensor:
        """``[H, budget pages x bs]`` token ids (-1: none). A decoding step's choice of
        blocks is noted as blocks and spelled out in tokens only when read (Mosaic's
        deferred splits, tests): most steps never read it."""
        if self._blocks is not None:
            blocks, bs = self._blocks
            self._blocks = None
            self._held[:, :blocks.shape[1] * bs] = block_tokens(blocks, bs)
            self._held[:, blocks.shape[1] * bs:] = -1
        return self._held

    def hold_in_order(self, lh: LayerHistory) -> None:
        """Every history block in order, block b at page b (as vLLM's own cache
        holds them: the kernel sums in the same order, over the same bytes); pages
        from the first that holds another block on are copied (the history grows
        at its end, so mostly only its newest)."""
        n, bs = lh.num_tokens, lh.block_size
        differs = (self.held[:, :n] != torch.arange(n)).any(0).nonzero()
        if differs.numel():
            first = int(differs[0]) // bs
            self.buffer[first:n // bs] = lh.pages[first:n // bs]
        self._note(torch.arange(n // bs).expand(lh.heads, -1), bs)

    def hold_blocks(self, lh: LayerHistory, blocks: torch.Tensor) -> None:
        """History blocks ``blocks`` ``[H, m]`` (per head) in the first ``m`` pages,
        in that order: a head's share of a page is one contiguous run, so the
        whole choice is one row copy out of the history's pages."""
        H, m = blocks.shape
        rows = blocks.mul(H).add_(self._head_rows).T.flatten()                      # [m, H] order
        width = self.buffer[0, 0].numel()
        torch.index_select(lh.pages.view(-1, width), 0, rows, out=self.buffer.view(-1, width)[:m * H])
        self._note(blocks, lh.block_size)

    def _note(self, blocks: torch.Tensor, bs: int) -> None:
        """The pages now hold ``blocks`` ``[H, m]``, whole."""
        self._blocks = (blocks, bs)
        self.m = blocks.shape[1]

    def hold(self, lh: LayerHistory, want: torch.Tensor) -> None:
        """The tokens ``want`` ``[H, N]`` (N a whole number of pages) in the first
        pages, in that order, written whole with vLLM's packing op: its cost is
        bounded by the budget whatever changed, where scattering only the changed
        tokens costs about 2 us each (16 K history, 2 048 tokens per head on an
        AVX2 core: 0.33 ms for all of them, 4.5 ms to scatter the half that an
        unrelated query changes; served decoding, where few change, timed alike)."""
        n = want.shape[1]
        write_history_pages(self.buffer, lh, want)
        self._blocks = None
        self._held[:, :n] = want
        self._held[:, n:] = -1
        self.m = n // lh.block_size


WRITE_AT_ONCE = 4096         # positions gathered and packed at a time


def write_history_pages(pages: torch.Tensor, lh: LayerHistory, tokens: torch.Tensor) -> None:
    """History tokens ``tokens`` ``[H, N]`` (per head; N a whole number of pages)
    into the first ``N / bs`` of ``pages``, position by position, with vLLM's own
    packing op (a whole page run: no per-token scatter). ``WRITE_AT_ONCE``
    positions at a time: their rows are small allocations the allocator reuses,
    where a prefill chunk's 64 groups at once (64 K positions, 50 MB of float32
    keys) were fresh memory each layer, and the page faults took most of the
    time (24 K history on an AVX2 core: 110 ms against 46 ms in pieces)."""
    for a in range(0, tokens.shape[1], WRITE_AT_ONCE):
        part = tokens[:, a:a + WRITE_AT_ONCE]
        k, v = lh.token_rows(part)
        lh.packing.pack(k, v, pages, torch.arange(a, a + part.shape[1]))
