"""Each tier as one object with both its halves, as vLLM's ``OffloadingSpec``
pairs a medium's scheduler-side manager with its worker-side handlers.

A ``TierSpec`` is built from the settings alone, in the scheduler's process and
in every worker's; each side asks it for its own half:

    tier    scheduler_half                                   worker_half
    host    scheduler.chunks.TierBudget (an eviction policy)  tiers.host.HostTier
    disk    scheduler.chunks.TierBudget (an eviction policy)  tiers.disk.DiskTier
    remote  scheduler.remote_lookups.RemoteLookups            tiers.remote.RemoteTier

A local tier's budget is then changed only by ``scheduler.chunks.ChunkStore``,
which owns the index over all of them. Each half is imported where it is
built, so a process loads only its own side's code."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvreel.connector.config import KVReelConfig
from kvreel.connector.tiers import ChunkTier, Tier


class TierSpec(ABC):
    kind: Tier
    local = True         # held by this engine (a byte budget), or shared by engines (looked up)

    def __init__(self, cfg: KVReelConfig, identity: str):
        self.cfg, self.identity = cfg, identity

    @abstractmethod
    def scheduler_half(self, policy=None):
        """What the scheduler keeps of the tier: a local tier's ``TierBudget``
        (evicting in ``policy``'s order), the remote store's ``RemoteLookups``."""

    @abstractmethod
    def worker_half(self, rank: int, pages=None, kv_cache_config=None, description: dict | None = None) -> ChunkTier:
        """The ``ChunkTier`` a worker of ``rank`` reads and writes (``pages``: its
        ``PagedRegions``; ``description``: what the identity digest stands for)."""


class HostSpec(TierSpec):
    kind = Tier.HOST

    def scheduler_half(self, policy=None):
        from kvreel.scheduler.chunks import TierBudget
        return TierBudget(self.kind, self.cfg.cpu_bytes, policy)

    def worker_half(self, rank, pages=None, kv_cache_config=None, description=None) -> ChunkTier:
        from kvreel.connector.tiers.host import HostTier
        return HostTier()


class DiskSpec(TierSpec):
    kind = Tier.DISK

    def scheduler_half(self, policy=None):
        from kvreel.scheduler.chunks import TierBudget
        return TierBudget(self.kind, self.cfg.disk_bytes, policy)

    def worker_half(self, rank, pages=None, kv_cache_config=None, description=None) -> ChunkTier:
        from kvreel.connector.tiers.disk import DiskTier
        return DiskTier(self.cfg.disk_dir, self.identity, rank, self.cfg.disk_write_queue, description=description)


class RemoteSpec(TierSpec):
    kind = Tier.REMOTE
    local = False

    def scheduler_half(self, policy=None):
        from kvreel.scheduler.remote_lookups import RemoteLookups
        return RemoteLookups(self.cfg.remote_url, self.identity, self.cfg.remote_timeout_s,
                             self.cfg.remote_lookup_wait_ms / 1000)

    def worker_half(self, rank, pages=None, kv_cache_config=None, description=None) -> ChunkTier:
        """The rank's own namespace of the store (each rank holds its shard of the
        KV), in the stored forms the settings ask for; a video form needs the
        engine's KV layout (``kv_cache_config``)."""
        from kvreel.codec.forms import KVView, StoredForms
        from kvreel.connector.tiers.remote import RemoteTier
        cfg = self.cfg
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        kv_view = KVView(pages.block_bytes, spec) if "video" in cfg.remote_forms else None
        ident = self.identity if rank == 0 else f"{self.identity}-r{rank}"
        forms = StoredForms(ident, kinds=cfg.remote_forms, quant=cfg.remote_quant,
                            resolutions=cfg.remote_resolutions, kv_view=kv_view)
        forms.device = pages.device
        return RemoteTier(cfg.remote_url, forms, cfg.remote_timeout_s, cfg.remote_write_queue)


def tier_specs(cfg: KVReelConfig, identity: str) -> dict[Tier, TierSpec]:
    """The tiers ``cfg`` turns on, host first: disk with ``KVREEL_DISK_DIR``,
    remote with ``KVREEL_REMOTE_URL``."""
    specs: list[TierSpec] = [HostSpec(cfg, identity)]
    if cfg.disk_dir:
        specs.append(DiskSpec(cfg, identity))
    if cfg.remote_url:
        specs.append(RemoteSpec(cfg, identity))
    return {spec.kind: spec for spec in specs}
