"""Messages between the scheduler-side and worker-side halves of the connector.

The scheduler side owns every decision (what is stored where, what is evicted,
what is loaded into which blocks); the worker side only moves bytes and reports
what went wrong, so both halves agree even when they live in different
processes (vLLM runs workers in their own processes, also on one CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvreel.connector.tiers import Tier

GroupBlockIds = tuple[list[int], ...]
"""Block ids per KV cache group, position by position (one list per group; with
vLLM's hybrid KV cache manager a sliding-window group holds NULL_BLOCK where a
position left its window)."""


@dataclass
class StoreOp:
    """Copy ``block_ids`` (per KV cache group) out of the paged cache as chunk ``key`` into ``tiers``."""
    key: bytes
    block_hashes: list[bytes]
    block_ids: GroupBlockIds
    tiers: set[Tier]


@dataclass
class LoadPiece:
    """Rows ``[first, first + rows)`` of chunk ``key`` go into ``block_ids`` (per KV cache group)."""
    key: bytes
    tier: Tier
    first: int
    block_ids: GroupBlockIds
    promote_to_host: bool = False

    @property
    def rows(self) -> int:
        return len(self.block_ids[0])

    @property
    def row_slice(self) -> slice:
        return slice(self.first, self.first + self.rows)

    def extends(self, key: bytes, row: int) -> bool:
        """Row ``row`` of chunk ``key`` continues this piece."""
        return self.key == key and self.first + self.rows == row

    def append(self, block_ids: GroupBlockIds, position: int) -> None:
        for mine, ids in zip(self.block_ids, block_ids):
            mine.append(ids[position])

    @classmethod
    def at(cls, key: bytes, tier: Tier, row: int, block_ids: GroupBlockIds, position: int) -> "LoadPiece":
        """A piece of one row, into the blocks at ``position`` of ``block_ids``."""
        return cls(key, tier, row, tuple([ids[position]] for ids in block_ids))


@dataclass
class HistoryPiece:
    """Rows ``[first, first + n)`` of chunk ``key`` are blocks ``first_block...`` of a
    long request's history: they go to its history store, not into vLLM's cache."""
    key: bytes
    tier: Tier
    first: int
    n: int
    first_block: int


@dataclass
class LoadOp:
    req_id: str
    pieces: list[LoadPiece]
    is_async: bool
    history: list[HistoryPiece] = field(default_factory=list)


@dataclass
class KVReelMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    evictions: dict[Tier, list[bytes]] = field(default_factory=dict)
    history: object | None = None      # retrieval's HistoryStep, when KVREEL_RETRIEVAL is on
    prefetches: list[tuple[bytes, Tier]] = field(default_factory=list)   # chunks to read into the host tier
    written_blocks: set[int] = field(default_factory=set)   # blocks this step overwrites (any KV cache group)


@dataclass
class KVReelWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: chunks that must be forgotten, writes that did not
    land and tiers that went off or came back (per tier), prefetches that
    landed (counted per worker: each holds its own shard), and the bytes its
    long requests' histories take where that changed (the most any worker holds)."""
    bad_keys: set[bytes] = field(default_factory=set)          # failed verification
    failed_writes: dict[Tier, set[bytes]] = field(default_factory=dict)
    tiers_off: dict[Tier, str] = field(default_factory=dict)   # why
    tiers_back: set[Tier] = field(default_factory=set)
    prefetched: dict[bytes, int] = field(default_factory=dict)
    prefetch_failed: set[bytes] = field(default_factory=set)
    history_bytes: int | None = None

    def aggregate(self, other: "KVReelWorkerMeta") -> "KVReelWorkerMeta":
        landed = dict(self.prefetched)
        for key, n in other.prefetched.items():
            landed[key] = landed.get(key, 0) + n
        failed = {t: self.failed_writes.get(t, set()) | other.failed_writes.get(t, set())
                  for t in {*self.failed_writes, *other.failed_writes}}
        reported = [n for n in (self.history_bytes, other.history_bytes) if n is not None]
        return KVReelWorkerMeta(self.bad_keys | other.bad_keys, failed, {**other.tiers_off, **self.tiers_off},
                                self.tiers_back | other.tiers_back, landed,
                                self.prefetch_failed | other.prefetch_failed, max(reported, default=None))

    def is_empty(self) -> bool:
        return not (self.bad_keys or self.failed_writes or self.tiers_off or self.tiers_back or self.prefetched
                    or self.prefetch_failed or self.history_bytes is not None)
