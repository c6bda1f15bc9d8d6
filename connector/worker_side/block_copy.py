"""Copy whole KV pages between vLLM's paged cache and host tensors.

Pages are moved as raw bytes (int8 views of the cache storage), whatever the
backend's packing (the CPU backend's ISA-specific layout, FlashAttention's
[2, blocks, ...] split), so restoring a page gives back exactly the bytes vLLM
wrote. The views follow ``KVCacheConfig.kv_cache_tensors`` placement, as vLLM's
own offloading workers do.
"""

from __future__ import annotations

import torch

from kvreel.connector.metadata import GroupBlockIds
from kvreel.connector.vllm_internals import NULL_BLOCK

# Above this many runs of consecutive blocks, a CUDA copy gathers on the device
# first: many small DMAs are far slower than one kernel plus one large DMA.
MAX_DMA_RUNS = 8




def _region_plan(kv_cache_config) -> list[tuple[int, int, int, int]]:
    """(group, placement index, byte offset, block stride) of every region, group by group.

    A region is one layer's pages (one per placement for block-outermost layouts).
    vLLM's hybrid KV cache manager overlays the groups' tensors on the same bytes
    (a block id belongs to one group at a time), so regions are told apart per
    group: the same offset in two groups is two regions, each addressed with its
    own group's block ids."""
    num_blocks = kv_cache_config.num_blocks
    groups = copied_groups(kv_cache_config)
    plan = []
    for g in groups:
        names = set(kv_cache_config.kv_cache_groups[g].layer_names)
        seen: set[int] = set()
        for p, placement in enumerate(kv_cache_config.kv_cache_tensors):
            mine = [i for i, name in enumerate(placement.layers) if name in names]
            if not mine:
                continue
            if placement.layer_stride >= num_blocks * placement.block_stride:   # layer-outermost
                starts = [placement.offset + i * placement.layer_stride for i in mine]
            elif len(mine) == len(placement.layers):                           # a block packs all layers
                starts = [placement.offset]
            else:
                raise RuntimeError("kvreel: a block-outermost KV cache packs layers of several KV cache groups; "
                                   "not supported")
            for start in starts:
                if start not in seen:        # layers sharing their KV within a group are one region
                    seen.add(start)
                    plan.append((g, p, start, placement.block_stride))
    if not plan:
        raise RuntimeError("kvreel: the engine registered no KV cache tensors")
    sizes = {stride for *_, stride in plan}
    if len(sizes) != 1:
        raise RuntimeError(f"kvreel: layers with different page sizes ({sorted(sizes)}) are not supported")
    return plan


def copied_groups(kv_cache_config) -> tuple[int, ...]:
    """The KV cache groups kvreel stores and restores: those vLLM lets a
    hash-addressed store restore (the connector refuses models with others:
    ``check_kv_cache_groups``)."""
    groups = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    return tuple(groups) if groups is not None else tuple(range(len(kv_cache_config.kv_cache_groups)))


class PagedRegions:
    """Every [num_blocks, block_bytes] byte view that together holds a block's KV,
    each addressed by the block ids of its KV cache group."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config) -> None:
        num_blocks = kv_cache_config.num_blocks
        self.regions: list[torch.Tensor] = []
        self.group_of: list[int] = []
        for g, p, start, stride in _region_plan(kv_cache_config):
            placement = kv_cache_config.kv_cache_tensors[p]
            name = next((n for n in placement.layers if n in kv_caches), None)
            if name is None:
                continue
            cache = kv_caches[name]
            raw = torch.empty(0, dtype=torch.int8, device=cache.device).set_(cache.untyped_storage())
            self.regions.append(raw[start:start + num_blocks * stride].view(num_blocks, stride))
            self.group_of.append(g)
        if not self.regions:
            raise RuntimeError("kvreel: the engine registered no KV cache tensors")
        self.block_bytes = self.regions[0].shape[1]
        self.device = self.regions[0].device
        self.is_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None

    @property
    def bytes_per_block(self) -> int:
        return len(self.regions) * self.block_bytes

    def empty_host(self, num_blocks: int) -> torch.Tensor:
        return torch.empty((len(self.regions), num_blocks, self.block_bytes), dtype=torch.uint8,
                           pin_memory=self.is_cuda)

    def gather(self, block_ids: GroupBlockIds) -> torch.Tensor:
        """Copy blocks (ids per KV cache group) out of the paged cache into a new
        host tensor [regions, n, block_bytes].

        Runs of consecutive block ids move as one slice copy (on CUDA one DMA
        per run and region, straight into pinned memory, on a side stream);
        only scattered blocks pay for an index_select."""
        out = self.empty_host(len(block_ids[0]))
        dst = out.view(torch.int8)
        stream = self._side_stream_after_compute()
        with _on(stream):
            for lo, hi, ids in self._by_group(block_ids):
                if NULL_BLOCK in ids:
                    raise ValueError("kvreel: a stored block must be held by every KV cache group")
                runs = list(_runs(ids))
                if self.is_cuda and len(runs) > MAX_DMA_RUNS:
                    # scattered blocks: one gather kernel per region, then one DMA
                    idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                    dst[lo:hi].copy_(torch.stack([self.regions[r].index_select(0, idx) for r in range(lo, hi)]),
                                     non_blocking=True)
                    continue
                for first, start, n in runs:
                    for r in range(lo, hi):
                        dst[r, first:first + n].copy_(self.regions[r][start:start + n], non_blocking=self.is_cuda)
        if stream is not None:
            stream.synchronize()
        return out

    def scatter(self, host: torch.Tensor, block_ids: GroupBlockIds, rows: slice | None = None,
                first_region: int = 0) -> None:
        """Write host rows [regions, n, block_bytes] (or host[:, rows]) into the given
        blocks (ids per KV cache group; NULL_BLOCK positions are left out: a
        sliding-window group does not hold them); with ``first_region`` the host
        tensor holds only regions from there on."""
        src = (host if rows is None else host[:, rows]).view(torch.int8)
        last = first_region + src.shape[0]
        stream = self._stream
        with _on(stream):
            for lo, hi, ids in self._by_group(block_ids):
                lo, hi = max(lo, first_region), min(hi, last)
                if lo >= hi:
                    continue
                runs = list(_runs(ids))
                if self.is_cuda and len(runs) > MAX_DMA_RUNS:
                    # scattered blocks: one DMA per region straight from the pinned rows
                    # (an index on the host would first copy them into pageable memory),
                    # then one scatter kernel; positions left out are dropped on the device
                    keep = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
                    idx = torch.tensor([ids[i] for i in keep], dtype=torch.long, device=self.device)
                    picked = (torch.tensor(keep, dtype=torch.long, device=self.device)
                              if len(keep) < len(ids) else None)
                    for r in range(lo, hi):
                        dev = src[r - first_region].to(self.device, non_blocking=True)
                        self.regions[r].index_copy_(0, idx, dev if picked is None else dev.index_select(0, picked))
                    continue
                for first, start, n in runs:
                    for r in range(lo, hi):
                        self.regions[r][start:start + n].copy_(src[r - first_region, first:first + n],
                                                               non_blocking=self.is_cuda)
        if stream is not None:
            stream.synchronize()

    def _by_group(self, block_ids: GroupBlockIds):
        """(first region, end region, block ids) per KV cache group (its regions are consecutive)."""
        lo = 0
        while lo < len(self.regions):
            hi = lo
            while hi < len(self.regions) and self.group_of[hi] == self.group_of[lo]:
                hi += 1
            yield lo, hi, block_ids[self.group_of[lo]]
            lo = hi

    def _side_stream_after_compute(self):
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream


def _on(stream):
    import contextlib
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _runs(block_ids: list[int]):
    """(position in the list, first block id, length) of each run of consecutive
    ids; NULL_BLOCK positions belong to no run."""
    i = 0
    while i < len(block_ids):
        if block_ids[i] == NULL_BLOCK:
            i += 1
            continue
        j = i + 1
        while j < len(block_ids) and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        yield i, block_ids[i], j - i
        i = j


def layout_of(kv_cache_config) -> tuple[int, int]:
    """(regions, block_bytes) that PagedRegions will find, computed without tensors
    so the scheduler side can size its tiers."""
    plan = _region_plan(kv_cache_config)
    return len(plan), plan[0][3]
