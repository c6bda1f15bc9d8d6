"""kvreel's tiers in vLLM's KV cache events.

A chunk entering or leaving a tier is published as vLLM's own ``BlockStored`` /
``BlockRemoved`` through vLLM's publisher (on with ``--kv-events-config``, off
otherwise), so a KV-aware router sees what kvreel can serve and not only what
vLLM's paged cache holds: a prefix evicted from the engine into kvreel's host
tier stays routable to this engine.

Tiers are named in vLLM's offloading vocabulary (``vllm.v1.kv_offload``): host
memory is medium CPU, locality LOCAL; disk STORAGE, LOCAL; the remote store
STORAGE, REMOTE, with ``ownership`` naming it (``REMOTE_OWNERSHIP``: vLLM's field
for a secondary offloading tier's identifier, as its KVCR tier sets it;
``vllm-router`` indexes such blocks in its external tier, credited to the
publishing engine, and where it checks batches rejects a step's whole batch
over a REMOTE event that names no owner). The hashes are the chunk's vLLM
block hashes, the keys a lookup serves from, and an event is recorded exactly
when the scheduler's index (what lookups read) changes, so an announced block
is one a request can load.

Limits: chunks found on disk at start-up, or fetched from the remote store by
a workflow prefetch, carry no token ids or parent (their stored forms hold
hashes, not tokens), so they are not announced: routers index blocks by their
tokens, and ``vllm-router`` (where it checks batches) drops a step's whole
batch when one stored event lacks them. A chunk in the remote store is
announced by the engine that uploaded it, and its eviction by the store itself
is not seen."""

from __future__ import annotations

from collections import OrderedDict

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvreel.connector.tiers import Tier
from kvreel.connector.vllm_internals import event_block_hash

REMOTE_OWNERSHIP = "kvreel-remote"
UPLOADS_REMEMBERED = 4096
# tier -> the event's (medium, locality, ownership)
RESIDENCY = {Tier.HOST: ("CPU", "LOCAL", None), Tier.DISK: ("STORAGE", "LOCAL", None),
             Tier.REMOTE: ("STORAGE", "REMOTE", REMOTE_OWNERSHIP)}


class TierEvents:
    """Events recorded since vLLM last took them (``take``, once per step)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        # remote uploads announced, by chunk key: a failed one is announced gone
        # (failures come back within the bounded upload queue's turnover)
        self._uploads: OrderedDict[bytes, list[bytes]] = OrderedDict()

    def stored(self, chunk, tier: Tier) -> None:
        """``chunk`` is in ``tier`` now; not announced without its tokens (module docstring)."""
        if not chunk.token_ids:
            return
        medium, locality, ownership = RESIDENCY[tier]
        self._events.append(BlockStored(
            block_hashes=[event_block_hash(h) for h in chunk.block_hashes],
            parent_block_hash=event_block_hash(chunk.parent) if chunk.parent is not None else None,
            token_ids=list(chunk.token_ids), block_size=self.block_size, lora_id=None,
            medium=medium, lora_name=None, locality=locality, ownership=ownership))
        if tier == Tier.REMOTE:
            self._uploads[chunk.key] = chunk.block_hashes
            if len(self._uploads) > UPLOADS_REMEMBERED:
                self._uploads.popitem(last=False)

    def upload_failed(self, key: bytes) -> None:
        """The remote upload of chunk ``key`` failed: its blocks are not there after all."""
        block_hashes = self._uploads.pop(key, None)
        if block_hashes is not None:
            self.removed(block_hashes, Tier.REMOTE)

    def removed(self, block_hashes: list[bytes], tier: Tier) -> None:
        medium, locality, ownership = RESIDENCY[tier]
        self._events.append(BlockRemoved(block_hashes=[event_block_hash(h) for h in block_hashes],
                                         medium=medium, locality=locality, ownership=ownership))

    def take(self) -> list[KVCacheEvent]:
        taken, self._events = self._events, []
        return taken
