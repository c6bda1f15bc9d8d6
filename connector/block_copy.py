"""Copy whole KV pages between vLLM's paged cache and host tensors.

Pages are moved as raw bytes (int8 views of the cache storage), whatever the
backend's packing (the CPU backend's ISA-specific layout, FlashAttention's
[2, blocks, ...] split), so restoring a page gives back exactly the bytes vLLM
wrote. The views follow ``KVCacheConfig.kv_cache_tensors`` placement, as vLLM's
own offloading workers do.
"""

from __future__ import annotations

import torch


class PagedRegions:
    """Every [num_blocks, block_bytes] byte view that together holds a block's KV."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config) -> None:
        num_blocks = kv_cache_config.num_blocks
        regions: list[torch.Tensor] = []
        seen: set[int] = set()
        for placement in kv_cache_config.kv_cache_tensors:
            name = next((n for n in placement.layers if n in kv_caches), None)
            if name is None:
                continue
            cache = kv_caches[name]
            raw = torch.empty(0, dtype=torch.int8, device=cache.device).set_(cache.untyped_storage())
            span = num_blocks * placement.block_stride
            if placement.layer_stride >= span:      # layer-outermost: one region per layer
                starts = [placement.offset + i * placement.layer_stride for i in range(len(placement.layers))]
            else:                                   # block-outermost: a block packs all layers
                starts = [0]
            for start in starts:
                region = raw[start:start + span].view(num_blocks, placement.block_stride)
                if region.data_ptr() not in seen:
                    seen.add(region.data_ptr())
                    regions.append(region)
        if not regions:
            raise RuntimeError("kvreel: the engine registered no KV cache tensors")
        sizes = {r.shape[1] for r in regions}
        if len(sizes) != 1:
            raise RuntimeError(f"kvreel: layers with different page sizes ({sorted(sizes)}) are not supported")
        self.regions = regions
        self.block_bytes = sizes.pop()
        self.device = regions[0].device
        self.is_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None

    @property
    def bytes_per_block(self) -> int:
        return len(self.regions) * self.block_bytes

    def empty_host(self, num_blocks: int) -> torch.Tensor:
        return torch.empty((len(self.regions), num_blocks, self.block_bytes), dtype=torch.uint8,
                           pin_memory=self.is_cuda)

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """Copy blocks out of the paged cache into a new host tensor [regions, n, block_bytes]."""
        out = self.empty_host(len(block_ids))
        if not self.is_cuda:
            idx = torch.tensor(block_ids, dtype=torch.long)
            for r, region in enumerate(self.regions):
                torch.index_select(region, 0, idx, out=out[r].view(torch.int8))
            return out
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staged = torch.stack([region.index_select(0, idx) for region in self.regions])
            out.view(torch.int8).copy_(staged, non_blocking=True)
        self._stream.synchronize()
        return out

    def scatter(self, host: torch.Tensor, block_ids: list[int], rows: slice | None = None) -> None:
        """Write host rows [regions, n, block_bytes] (or host[:, rows]) into the given blocks."""
        src = host if rows is None else host[:, rows]
        if not self.is_cuda:
            idx = torch.tensor(block_ids, dtype=torch.long)
            for r, region in enumerate(self.regions):
                region.index_copy_(0, idx, src[r].view(torch.int8))
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        with torch.cuda.stream(self._stream):
            dev = src.to(self.device, non_blocking=True).view(torch.int8)
            for r, region in enumerate(self.regions):
                region.index_copy_(0, idx, dev[r])
        self._stream.synchronize()


def layout_of(kv_cache_config) -> tuple[int, int]:
    """(regions, block_bytes) that PagedRegions will find, computed without tensors
    so the scheduler side can size its tiers."""
    num_blocks = kv_cache_config.num_blocks
    regions, sizes = 0, set()
    for placement in kv_cache_config.kv_cache_tensors:
        outermost = placement.layer_stride >= num_blocks * placement.block_stride
        regions += len(placement.layers) if outermost else 1
        sizes.add(placement.block_stride)
    if len(sizes) != 1:
        raise RuntimeError(f"kvreel: layers with different page sizes ({sorted(sizes)}) are not supported")
    return regions, sizes.pop()
