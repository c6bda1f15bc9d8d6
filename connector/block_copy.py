"""Copy whole KV pages between vLLM's paged cache and host tensors.

Pages are moved as raw bytes (int8 views of the cache storage), whatever the
backend's packing (the CPU backend's ISA-specific layout, FlashAttention's
[2, blocks, ...] split), so restoring a page gives back exactly the bytes vLLM
wrote. The views follow ``KVCacheConfig.kv_cache_tensors`` placement, as vLLM's
own offloading workers do.
"""

from __future__ import annotations

import torch

# Above this many runs of consecutive blocks, a CUDA copy gathers on the device
# first: many small DMAs are far slower than one kernel plus one large DMA.
MAX_DMA_RUNS = 8


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
        """Copy blocks out of the paged cache into a new host tensor [regions, n, block_bytes].

        Runs of consecutive block ids move as one slice copy (on CUDA one DMA
        per run and region, straight into pinned memory, on a side stream);
        only scattered blocks pay for an index_select."""
        out = self.empty_host(len(block_ids))
        dst = out.view(torch.int8)
        runs = list(_runs(block_ids))
        stream = self._side_stream_after_compute()
        with _on(stream):
            if self.is_cuda and len(runs) > MAX_DMA_RUNS:
                # scattered blocks: one gather kernel per region, then one DMA
                idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
                dst.copy_(torch.stack([region.index_select(0, idx) for region in self.regions]), non_blocking=True)
            else:
                for first, start, n in runs:
                    for r, region in enumerate(self.regions):
                        dst[r, first:first + n].copy_(region[start:start + n], non_blocking=self.is_cuda)
        if stream is not None:
            stream.synchronize()
        return out

    def scatter(self, host: torch.Tensor, block_ids: list[int], rows: slice | None = None,
                first_region: int = 0) -> None:
        """Write host rows [regions, n, block_bytes] (or host[:, rows]) into the given
        blocks; with ``first_region`` the host tensor holds only regions from there on."""
        src = (host if rows is None else host[:, rows]).view(torch.int8)
        regions = self.regions[first_region:first_region + src.shape[0]]
        runs = list(_runs(block_ids))
        stream = self._stream
        with _on(stream):
            if self.is_cuda and len(runs) > MAX_DMA_RUNS:
                idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
                dev = src.to(self.device, non_blocking=True)
                for r, region in enumerate(regions):
                    region.index_copy_(0, idx, dev[r])
            else:
                for first, start, n in runs:
                    for r, region in enumerate(regions):
                        region[start:start + n].copy_(src[r, first:first + n], non_blocking=self.is_cuda)
        if stream is not None:
            stream.synchronize()

    def _side_stream_after_compute(self):
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream


def _on(stream):
    import contextlib
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _runs(block_ids: list[int]):
    """(position in the list, first block id, length) of each run of consecutive ids."""
    i = 0
    while i < len(block_ids):
        j = i + 1
        while j < len(block_ids) and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        yield i, block_ids[i], j - i
        i = j


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
