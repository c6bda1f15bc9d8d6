"""kvreel's tier events as vLLM's publisher sends them (msgpack of vLLM's own
``KVEventBatch``): the remote store named as an owned REMOTE tier, and no
stored event without the block's tokens (a router indexes blocks by tokens;
vllm-router drops a step's whole batch over one such event)."""

from array import array

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvreel.scheduler.chunks import Chunk
from kvreel.scheduler.events import REMOTE_OWNERSHIP, TierEvents
from kvreel.connector.tiers import Tier

BS = 4


def _chunk(first: int, tokens: bool) -> Chunk:
    chunk = Chunk(bytes([first]) * 32, [bytes([first + i]) * 32 for i in range(2)], 1024)
    chunk.parent = bytes([first - 1]) * 32
    chunk.token_ids = array("l", range(first, first + 2 * BS)) if tokens else None
    return chunk


def _sent(events: TierEvents) -> list:
    """The events after the publisher's encoding and a subscriber's decoding."""
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events.take()))
    return msgspec.msgpack.decode(wire, type=KVEventBatch).events


def test_each_tier_is_named_and_the_remote_store_has_an_owner():
    events = TierEvents(BS)
    with_tokens = _chunk(10, tokens=True)
    for tier in (Tier.HOST, Tier.DISK, Tier.REMOTE):
        events.stored(with_tokens, tier)
    events.removed(with_tokens.block_hashes, Tier.REMOTE)
    host, disk, remote, gone = _sent(events)
    assert isinstance(remote, BlockStored) and isinstance(gone, BlockRemoved)
    assert [(e.medium, e.locality, e.ownership) for e in (host, disk, remote, gone)] == [
        ("CPU", "LOCAL", None), ("STORAGE", "LOCAL", None),
        ("STORAGE", "REMOTE", REMOTE_OWNERSHIP), ("STORAGE", "REMOTE", REMOTE_OWNERSHIP)]
    assert remote.token_ids == list(range(10, 10 + 2 * BS)) and remote.block_size == BS
    assert len(remote.block_hashes) * BS == len(remote.token_ids)


def test_a_chunk_without_its_tokens_is_not_announced():
    events = TierEvents(BS)
    events.stored(_chunk(20, tokens=False), Tier.DISK)      # found on disk at start-up: hashes only
    events.stored(_chunk(30, tokens=True), Tier.DISK)
    sent = _sent(events)
    assert len(sent) == 1 and sent[0].token_ids == list(range(30, 30 + 2 * BS))


def test_a_failed_upload_takes_back_exactly_the_blocks_it_announced():
    events = TierEvents(BS)
    uploaded = _chunk(40, tokens=True)
    events.stored(uploaded, Tier.REMOTE)
    events.upload_failed(uploaded.key)
    events.upload_failed(uploaded.key)                     # reported twice (two workers): taken back once
    events.upload_failed(b"\x01" * 32)                     # never announced (no tokens, or long ago)
    stored, gone = _sent(events)
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == stored.block_hashes
    assert (gone.medium, gone.locality, gone.ownership) == ("STORAGE", "REMOTE", REMOTE_OWNERSHIP)
