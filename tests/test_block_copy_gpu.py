"""The connector's CUDA copy path (GPU machine): scattered blocks, a hybrid
model's NULL_BLOCK positions and a slice of a chunk's rows land byte for byte."""

from types import SimpleNamespace

import pytest
import torch

from kvreel.connector.worker_side.block_copy import MAX_DMA_RUNS, PagedRegions
from kvreel.connector.vllm_internals import NULL_BLOCK

pytestmark = pytest.mark.gpu
LAYERS, BLOCKS, PAGE = 4, 256, 4096


def paged_cache():
    cache = torch.randint(0, 255, (LAYERS, BLOCKS, PAGE), dtype=torch.uint8, device="cuda")
    names = [f"l{i}" for i in range(LAYERS)]
    placement = SimpleNamespace(layers=names, layer_stride=BLOCKS * PAGE, block_stride=PAGE, offset=0)
    cfg = SimpleNamespace(num_blocks=BLOCKS, kv_cache_tensors=[placement],
                          kv_cache_groups=[SimpleNamespace(layer_names=names)])
    return cache, PagedRegions({n: cache[i] for i, n in enumerate(names)}, cfg)


def test_scattered_blocks_round_trip_with_null_positions_and_row_slices():
    cache, pages = paged_cache()
    source = torch.randperm(BLOCKS - 1)[: 4 * MAX_DMA_RUNS].add_(1).tolist()
    host = pages.gather((source,))
    assert torch.equal(host.cuda(), cache[:, source])

    target = torch.randperm(BLOCKS - 1)[: len(source)].add_(1).tolist()
    target[3] = NULL_BLOCK                        # a position a sliding-window group does not hold
    before = cache.clone()
    rows = slice(2, len(source))
    pages.scatter(host, (target[rows],), rows=rows)
    written = [b for b in target[rows] if b != NULL_BLOCK]
    expected = host[:, rows][:, [i for i, b in enumerate(target[rows]) if b != NULL_BLOCK]]
    assert torch.equal(cache[:, written].cpu(), expected)
    untouched = sorted(set(range(BLOCKS)) - set(written))
    assert torch.equal(cache[:, untouched], before[:, untouched])
