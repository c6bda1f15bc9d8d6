"""The scheduler side's record of what kvreel holds: every chunk, the index from
each block hash to (chunk, row), and the byte budgets of the local tiers with
their eviction order.

A *chunk* is a run of consecutive full blocks of one prefix, at most
``KVREEL_CHUNK_TOKENS`` long and never crossing a chunk boundary, keyed by the
digest of its block hashes (``kvreel.codec.formats.chunk_key``). Block keys are
vLLM's own chained prefix-cache block hashes, so a chunk's key names exactly
its blocks and the prefix before them. Every block maps to (chunk, row), so any
prefix of a held chunk is reusable: reuse is at block granularity.

Each local tier's budget is its scheduler half (``kvreel.connector.tiers.specs``
pairs it with the worker half). Eviction: each tier's budget asks its policy (``kvreel.scheduler.eviction``: LRU,
or with workflow hints the chunks whose agents run furthest in the future
first). The budgets and the step's stores and deletions change only through
``ChunkStore``'s methods."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import NamedTuple

from kvreel.connector.metadata import StoreOp
from kvreel.scheduler.events import TierEvents
from kvreel.connector.stats import KVReelStats
from kvreel.connector.tiers import Tier
from kvreel.scheduler.eviction import EvictionPolicy, LRUPolicy

HOST, DISK, REMOTE = Tier.HOST, Tier.DISK, Tier.REMOTE
MAX_USERS = 64          # (workflow, agent) pairs remembered per chunk


class Chunk:
    __slots__ = ("key", "block_hashes", "nbytes", "tiers", "pins", "users", "prefetched", "parent", "token_ids")

    def __init__(self, key: bytes, block_hashes: list[bytes], nbytes: int):
        self.key = key
        self.block_hashes = block_hashes
        self.nbytes = nbytes
        self.parent: bytes | None = None          # the hash of the block before it, for KV events
        self.token_ids: array | None = None       # its tokens, kept only while KV events are on
        self.tiers: set[Tier] = set()     # the local tiers (host, disk) holding it
        self.pins = 0
        self.users: set[tuple[str, str]] = set()   # (workflow, agent) pairs that used it
        self.prefetched = False           # in the host tier by a prefetch, not loaded since

    def used_by(self, user: tuple[str, str]) -> None:
        """``user``'s prompt holds this chunk: it takes that agent's distance."""
        if len(self.users) < MAX_USERS:
            self.users.add(user)


class BlockRef(NamedTuple):
    """Where the index finds a block: its chunk and its row in it."""
    chunk: Chunk
    row: int


class TierBudget:
    """Byte budget of one local tier: its chunks in LRU order and the bytes they
    (and anything charged to the tier) take; ``policy`` orders evictions (LRU
    when none is given). Only its owner, ``ChunkStore``, changes it."""

    def __init__(self, tier: Tier, capacity: int, policy: EvictionPolicy | None = None):
        self.tier = tier
        self.capacity = capacity
        self.used = 0
        self.lru: OrderedDict[bytes, Chunk] = OrderedDict()
        self.policy = policy or LRUPolicy()

    def touch(self, chunk: Chunk) -> None:
        if chunk.key in self.lru:
            self.lru.move_to_end(chunk.key)

    def victims_for(self, nbytes: int, nearest: float = 0, strictly: bool = False) -> list[Chunk] | None:
        """Unpinned chunks whose removal frees ``nbytes``, in the policy's order;
        None if impossible. A ranking policy lets only chunks needed no sooner
        than ``nearest`` steps (later than it, if ``strictly``) go."""
        if nbytes > self.capacity:
            return None
        need = self.used + nbytes - self.capacity
        if need <= 0:
            return []
        out = []
        for chunk in self.policy.order((c for c in self.lru.values() if c.pins == 0), nearest, strictly):
            if need <= 0:
                break
            out.append(chunk)
            need -= chunk.nbytes
        return out if need <= 0 else None

    def add(self, chunk: Chunk) -> None:
        self.lru[chunk.key] = chunk
        self.used += chunk.nbytes

    def remove(self, chunk: Chunk) -> None:
        if self.lru.pop(chunk.key, None) is not None:
            self.used -= chunk.nbytes


class ChunkStore:
    """The index and the local tiers' budgets, and what this step changes in
    them for the workers: chunks to store (``stores``) and to delete
    (``evictions``); with ``events``, every copy gained or lost is a KV event."""

    def __init__(self, stats: KVReelStats, budgets: list[TierBudget], events: TierEvents | None = None):
        self.stats = stats
        self.events = events
        self.index: dict[bytes, BlockRef] = {}
        self._by_key: dict[bytes, Chunk] = {}         # the indexed chunks
        self.budgets: dict[Tier, TierBudget] = {b.tier: b for b in budgets}     # the local tiers' halves
        if HOST not in self.budgets:
            raise ValueError("the host tier's budget is needed: loads and promotions land there")
        self.stores: dict[bytes, StoreOp] = {}
        self.evictions: dict[Tier, list[bytes]] = {}

    @property
    def host(self) -> TierBudget:
        return self.budgets[HOST]

    def take_step(self) -> tuple[list[StoreOp], dict[Tier, list[bytes]]]:
        """This step's stores (those still bound for a tier) and deletions, handed to the workers."""
        stores, evictions = [op for op in self.stores.values() if op.tiers], self.evictions
        self.stores, self.evictions = {}, {}
        return stores, evictions

    def plan_store(self, op: StoreOp) -> None:
        """``op``'s chunk is to be written this step; set before admitting it, so
        an eviction on the way drops a tier from ``op`` instead of deleting."""
        self.stores[op.key] = op

    def add(self, chunk: Chunk) -> None:
        """Index every block of ``chunk``."""
        for row, h in enumerate(chunk.block_hashes):
            self.index[h] = BlockRef(chunk, row)
        self._by_key[chunk.key] = chunk

    def touch(self, chunk: Chunk) -> None:
        """``chunk`` was used just now: the last of its tiers' copies to go."""
        for budget in self.budgets.values():
            budget.touch(chunk)

    def indexed(self, chunk: Chunk) -> bool:
        return self.holder(chunk.block_hashes[-1]) is chunk

    def admit(self, chunk: Chunk, tier: Tier, present: bool = True, nearest: float | None = None,
              strictly: bool = False) -> bool:
        """Make room (evicting in the tier's order) and account ``chunk`` in a local
        tier; ``present=False`` reserves the room for a copy still on its way (a
        promotion, a prefetch), which lookups may use once it has landed. Only
        chunks needed no sooner than ``nearest`` steps (the chunk's own need by
        default; later, if ``strictly``) may make room."""
        budget = self.budgets[tier]
        nearest = budget.policy.need(chunk) if nearest is None else nearest
        victims = budget.victims_for(chunk.nbytes, nearest, strictly)
        if victims is None:
            return False
        for victim in victims:
            self.evict(victim, tier)
        budget.add(chunk)
        if present:
            self.hold(chunk, tier)
        return True

    def hold(self, chunk: Chunk, tier: Tier) -> None:
        """``chunk`` is in ``tier`` now (written, or a promotion landed)."""
        if tier not in chunk.tiers:
            chunk.tiers.add(tier)
            if self.events is not None:
                self.events.stored(chunk, tier)

    def release(self, chunk: Chunk, tier: Tier) -> None:
        """Give back a reservation whose copy did not land everywhere (a worker
        may hold it: it is deleted there)."""
        self.budgets[tier].remove(chunk)
        self.evictions.setdefault(tier, []).append(chunk.key)

    def charge(self, tier: Tier, nbytes: int) -> None:
        """Bytes ``tier``'s memory holds besides its chunks (long sessions'
        histories beside the host tier); negative gives them back."""
        self.budgets[tier].used += nbytes

    def evict(self, chunk: Chunk, tier: Tier) -> None:
        self.drop_copy(chunk, tier)
        pending = self.stores.get(chunk.key)
        if pending is not None:
            pending.tiers.discard(tier)        # not written yet: nothing to delete
        else:
            self.evictions.setdefault(tier, []).append(chunk.key)
        self.stats.add("evicted_chunks", label=tier)

    def drop_copy(self, chunk: Chunk, tier: Tier) -> None:
        """Account a copy gone from a tier; a chunk in no local tier is forgotten."""
        self.budgets[tier].remove(chunk)
        if tier in chunk.tiers:
            chunk.tiers.discard(tier)
            if self.events is not None:
                self.events.removed(chunk.block_hashes, tier)
        if tier == HOST and chunk.prefetched:
            chunk.prefetched = False
            self.stats.add("prefetches", label="wasted")
        if not chunk.tiers:
            for h in chunk.block_hashes:
                if self.holder(h) is chunk:
                    del self.index[h]
            if self._by_key.get(chunk.key) is chunk:
                del self._by_key[chunk.key]

    def by_key(self, key: bytes) -> Chunk | None:
        """The indexed chunk whose key this is."""
        chunk = self._by_key.get(key)
        return chunk if chunk is not None and self.indexed(chunk) else None

    def holder(self, block_hash: bytes) -> Chunk | None:
        """The indexed chunk that holds a block."""
        ref = self.index.get(block_hash)
        return ref.chunk if ref is not None else None

    def drop(self, key: bytes) -> None:
        """Forget a chunk everywhere (it failed verification)."""
        chunk = self.by_key(key)
        if chunk is None:
            return
        for tier in list(chunk.tiers):
            self.evict(chunk, tier)

    def turn_off(self, tier: Tier) -> None:
        """A tier is gone (a worker could not write it): its copies with it."""
        budget = self.budgets.get(tier)
        if budget is None or tier == HOST:
            return
        for chunk in list(budget.lru.values()):
            self.drop_copy(chunk, tier)              # the copies are gone: no deletes to send
        del self.budgets[tier]

    def turn_on(self, budget: TierBudget) -> None:
        """A tier takes writes again: an empty budget (the disk's files are adopted anew)."""
        self.budgets.setdefault(budget.tier, budget)

    def reset(self) -> None:
        """Forget every unpinned chunk in every tier."""
        for tier, budget in list(self.budgets.items()):
            for chunk in [c for c in budget.lru.values() if c.pins == 0]:
                self.evict(chunk, tier)
