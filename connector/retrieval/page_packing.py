"""Plain per-token K and V <-> vLLM CPU cache pages, whatever the ISA packing.

The CPU backend's cache is ``[blocks, kv_heads, 2 * block_size, head_dim]``
per layer: for each head, a K part and a V part of ``block_size * head_dim``
values each, laid out as the ISA's kernel wants them (``vec`` stores K
transposed, ``amx`` differently again). kvreel does not hard-code any of these:
once per (block size, head_dim, dtype, ISA) it writes probe values through
vLLM's own ``cpu_attn_reshape_and_cache`` and reads back where each
(token, channel) landed. Unpacking is then one gather with that permutation;
packing is vLLM's op itself. Round trips are exact (the probe proves it)."""

from __future__ import annotations

import functools

import torch

from kvreel.connector.vllm_internals import cpu_reshape_and_cache


@functools.lru_cache(maxsize=None)
def _permutation(block_size: int, head_dim: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """[2, block_size * head_dim]: for K and V, the page position of (token, channel) t * head_dim + d."""
    bs, D = block_size, head_dim
    n = bs * D
    # bf16/fp16 hold integers up to 256 exactly: one probe per base-256 digit of the index
    digits = max(1, -(-(n - 1).bit_length() // 8))
    index = torch.arange(n).view(bs, 1, D)
    found = torch.zeros(2, n, dtype=torch.int64)
    cache = torch.zeros(1, 1, 2 * bs, D, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    for digit in range(digits):
        probe = ((index >> (8 * digit)) & 255).to(dtype)
        for part in range(2):
            cache.zero_()
            k, v = (probe, torch.zeros_like(probe)) if part == 0 else (torch.zeros_like(probe), probe)
            cpu_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(bs), isa)
            landed = cache[0, 0, part * bs:(part + 1) * bs].reshape(-1).to(torch.int64)
            found[part] |= landed << (8 * digit)
    # found[part][p] = the (t, d) index stored at page position p; invert it
    perm = torch.empty_like(found)
    for part in range(2):
        if not torch.equal(torch.sort(found[part]).values, torch.arange(n)):
            raise RuntimeError(f"vLLM's CPU cache packing for isa={isa!r} is not a permutation of its "
                               "input; kvreel cannot keep a host copy of this cache")
        perm[part][found[part]] = torch.arange(n)
    return perm


class PagePacking:
    """Unpack a layer's pages into plain K/V, and pack plain K/V into pages."""

    def __init__(self, block_size: int, head_dim: int, dtype: torch.dtype, isa: str):
        self.block_size, self.head_dim, self.dtype, self.isa = block_size, head_dim, dtype, isa
        self.perm = _permutation(block_size, head_dim, dtype, isa)

        # the V part as plain rows (token t's channels at t * D...): then one token's value is a row copy
        self.values_in_rows = bool(torch.equal(self.perm[1], torch.arange(block_size * head_dim)))

    def unpack(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages ``[n, H, 2 * bs, D]`` -> (K, V) each ``[n * bs, H, D]`` (tokens in order)."""
        return self.unpack_part(pages, 0), self.unpack_part(pages, 1)

    def unpack_part(self, pages: torch.Tensor, part: int) -> torch.Tensor:
        """K (``part`` 0) or V (1) of pages ``[n, H, 2 * bs, D]`` as ``[n * bs, H, D]``."""
        n, H = pages.shape[0], pages.shape[1]
        bs, D = self.block_size, self.head_dim
        # advanced indexing, not index_select: along the last dim of this strided view that took
        # 9x as long (one block of 3 heads of 128 x 64: 0.68 against 0.07 ms on an AVX2 core)
        x = pages.reshape(n, H, 2, bs * D)[:, :, part][..., self.perm[part]]
        return x.view(n, H, bs, D).transpose(1, 2).reshape(n * bs, H, D)     # [n, H, bs, D] -> [n bs, H, D]

    def values_at(self, pages: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The values ``[n, H, D]`` of tokens ``[H, n]`` (per head; token t in page
        ``t // bs``) of pages ``[N, H, 2 * bs, D]``, without unpacking the pages:
        a row copy per token where V is stored in rows, else an element gather
        through the permutation."""
        H, n = tokens.shape
        bs, D = self.block_size, self.head_dim
        at = (tokens // bs * H + torch.arange(H).unsqueeze(1)) * (2 * bs) + bs             # [H, n]: V part's first row
        within = (tokens % bs).T                                                        # [n, H]
        if self.values_in_rows:
            return pages.view(-1, D).index_select(0, (at.T + within).flatten()).view(n, H, D)
        return pages.view(-1).take(at.T.unsqueeze(-1) * D + self.perm[1].view(bs, D)[within])

    def pack(self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Write tokens ``[n, H, D]`` into ``cache`` ``[blocks, H, 2 * bs, D]`` at ``slots``."""
        key_cache, value_cache = cache.chunk(2, dim=2)
        cpu_reshape_and_cache(k, v, key_cache, value_cache, slots, self.isa)
