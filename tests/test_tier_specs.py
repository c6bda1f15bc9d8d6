"""Each tier as one object (``connector.tiers.specs``): the settings decide the
tiers, and the scheduler half and worker half built from one spec agree on
what the tier holds (real files on disk, a real directory store)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kvreel.codec.formats import chunk_key
from kvreel.connector.config import KVReelConfig
from kvreel.connector.stats import KVReelStats
from kvreel.connector.tiers import Tier
from kvreel.connector.tiers.disk import scan_chunk_files
from kvreel.connector.tiers.specs import tier_specs
from kvreel.scheduler.chunks import ChunkStore
from kvreel.scheduler.remote_lookups import RemoteLookups

ID = "model-x"
REGIONS, BLOCKS, BLOCK_BYTES = 2, 3, 256


def test_the_settings_turn_tiers_on():
    assert list(tier_specs(KVReelConfig.load(env={}), ID)) == [Tier.HOST]
    cfg = KVReelConfig.load(env={"KVREEL_REMOTE_URL": "file:///nowhere"})
    assert list(tier_specs(cfg, ID)) == [Tier.HOST, Tier.REMOTE]


def test_a_chunk_written_by_each_worker_half_is_found_by_its_scheduler_half(tmp_path):
    cfg = KVReelConfig.load(env={"KVREEL_CPU_BYTES": "1MiB", "KVREEL_DISK_DIR": str(tmp_path / "disk"),
                                 "KVREEL_DISK_BYTES": "2MiB", "KVREEL_REMOTE_URL": f"file://{tmp_path / 'store'}"})
    specs = tier_specs(cfg, ID)
    assert list(specs) == [Tier.HOST, Tier.DISK, Tier.REMOTE]
    budgets = [spec.scheduler_half() for spec in specs.values() if spec.local]
    assert {b.tier: b.capacity for b in budgets} == {Tier.HOST: 1 << 20, Tier.DISK: 2 << 20}
    lookups = specs[Tier.REMOTE].scheduler_half()
    assert isinstance(lookups, RemoteLookups)

    pages = SimpleNamespace(block_bytes=BLOCK_BYTES, device=torch.device("cpu"))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))])
    halves = {kind: spec.worker_half(0, pages, kv_cache_config, {"model": ID}) for kind, spec in specs.items()}
    assert {kind: half.kind for kind, half in halves.items()} == {kind: kind for kind in specs}
    hashes = [bytes([7, b]) * 16 for b in range(BLOCKS)]
    key = chunk_key(hashes)
    payload = torch.randint(0, 255, (REGIONS, BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
    try:
        for half in halves.values():
            assert half.put(key, hashes, payload)
            assert half.flush(60)
            assert torch.equal(half.get(key), payload)
        assert [found for found, _, _ in scan_chunk_files(cfg.disk_dir, ID)] == [key]
        deadline = time.monotonic() + 30
        while (pointers := lookups.poll("r", hashes)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pointers == [(key, row) for row in range(BLOCKS)]
    finally:
        lookups.close()
        for half in halves.values():
            half.close()


def test_the_chunk_store_needs_the_host_tiers_budget(tmp_path):
    cfg = KVReelConfig.load(env={"KVREEL_DISK_DIR": str(tmp_path)})
    disk_only = [spec.scheduler_half() for kind, spec in tier_specs(cfg, ID).items() if kind == Tier.DISK]
    with pytest.raises(ValueError, match="host tier's budget is needed"):
        ChunkStore(KVReelStats(), disk_only)
