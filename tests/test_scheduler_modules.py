"""The scheduler side's rooms, each on its own (no engine, no coordinator): the
chunk index and tier budgets, save planning and load planning."""

from __future__ import annotations

from types import SimpleNamespace

from kvreel.connector.config import KVReelConfig
from kvreel.scheduler.chunks import DISK, HOST, REMOTE, Chunk, ChunkStore, TierBudget
from kvreel.scheduler.eviction import WorkflowPolicy
from kvreel.scheduler.loads import LoadPlanner
from kvreel.scheduler.requests import RequestState
from kvreel.scheduler.saves import SavePlanner
from kvreel.connector.stats import KVReelStats
from kvreel.connector.tiers.specs import tier_specs
from kvreel.connector.vllm_internals import NULL_BLOCK

BS, BLOCK_BYTES = 32, 1024


def chunk(i: int, blocks: int = 2) -> Chunk:
    hashes = [bytes([i, b]) * 16 for b in range(blocks)]
    return Chunk(hashes[-1], hashes, blocks * BLOCK_BYTES)


def store(tmp_path, host_chunks: int = 3, disk: bool = True) -> ChunkStore:
    env = {"KVREEL_CPU_BYTES": str(host_chunks * 2 * BLOCK_BYTES), "KVREEL_CHUNK_TOKENS": str(2 * BS)}
    if disk:
        env |= {"KVREEL_DISK_DIR": str(tmp_path), "KVREEL_DISK_BYTES": "1MiB"}
    specs = tier_specs(KVReelConfig.load(env=env), "model-x")
    return ChunkStore(KVReelStats(), [spec.scheduler_half() for spec in specs.values()])


def request(i: int, blocks: int, prompt: int | None = None):
    hashes = [bytes([i, b]) * 16 for b in range(blocks)]
    tokens = blocks * BS + 1
    return SimpleNamespace(request_id=f"r{i}", block_hashes=hashes, num_tokens=tokens,
                           num_prompt_tokens=prompt or tokens)


def test_tier_budgets_evict_lru_or_the_furthest_needed_first():
    lru = TierBudget(HOST, 4 * BLOCK_BYTES)
    a, b, c = chunk(1), chunk(2), chunk(3)
    lru.add(a)
    lru.add(b)
    lru.touch(a)
    assert lru.victims_for(2 * BLOCK_BYTES) == [b]            # b least recently used
    b.pins = 1
    assert lru.victims_for(2 * BLOCK_BYTES) == [a]            # pinned chunks never go
    assert lru.victims_for(5 * BLOCK_BYTES) is None           # more than the tier holds
    far = TierBudget(HOST, 4 * BLOCK_BYTES, WorkflowPolicy(lambda ch: {a.key: 1, c.key: 7}[ch.key]))
    far.add(a)
    far.add(c)
    assert far.victims_for(2 * BLOCK_BYTES) == [c]            # needed 7 steps ahead: first to go
    assert far.victims_for(2 * BLOCK_BYTES, nearest=7, strictly=True) is None


def test_the_store_indexes_evicts_and_forgets(tmp_path):
    s = store(tmp_path, host_chunks=2)
    chunks = [chunk(i) for i in range(3)]
    for c in chunks:
        assert s.admit(c, HOST) and s.admit(c, DISK)
        s.add(c)
    assert s.evictions[HOST] == [chunks[0].key]               # the third pushed the first out of host memory
    assert chunks[0].tiers == {DISK} and s.indexed(chunks[0])
    s.drop(chunks[1].block_hashes[0])                         # not a chunk's key: nothing happens
    assert s.indexed(chunks[1])
    s.drop(chunks[1].key)                                     # damaged: gone from every tier and the index
    assert not chunks[1].tiers and chunks[1].block_hashes[0] not in s.index
    stores, evictions = s.take_step()
    assert stores == [] and evictions[DISK] == [chunks[1].key] and s.evictions == {}
    s.turn_off(DISK)                                          # a worker could not write: copies gone, no deletes
    assert DISK not in s.budgets and not s.indexed(chunks[0]) and s.evictions == {}
    s.turn_on(TierBudget(DISK, 10 * chunks[0].nbytes))          # it takes writes again: an empty budget
    assert s.budgets[DISK].used == 0 and s.admit(chunks[2], DISK) and chunks[2].tiers == {HOST, DISK}
    s.turn_on(TierBudget(DISK, 1))                              # already on: kept as it is
    assert s.budgets[DISK].used == chunks[2].nbytes
    chunks[2].pins = 1
    s.reset()
    assert s.indexed(chunks[2]) and s.host.used == chunks[2].nbytes


def test_saves_cut_chunks_at_their_boundaries_and_skip_what_is_held(tmp_path):
    s = store(tmp_path, host_chunks=8)
    saves = SavePlanner(KVReelConfig.load(env={"KVREEL_CHUNK_TOKENS": str(2 * BS)}), s, BS, BLOCK_BYTES,
                        remote=True)
    req = request(5, 5)
    st = RequestState(req, block_ids=([10, 11, 12, 13, 14],), saved_upto=1, from_remote={req.block_hashes[3]})
    saves.plan(st, computed_after=5 * BS)
    ops = {op.key: op for op in s.stores.values()}
    # block 0 was saved before; 1 ends chunk [0, 2); 2-3 and 4 are chunks of their own
    assert [op.block_hashes for op in ops.values()] == [req.block_hashes[1:2], req.block_hashes[2:4],
                                                         req.block_hashes[4:5]]
    assert all(REMOTE in op.tiers for op in ops.values())                  # 2-3: only block 3 came from there
    assert st.saved_upto == 5 and all(s.indexed(s.holder(h)) for h in req.block_hashes[1:])
    again = RequestState(req, block_ids=([10, 11, 12, 13, 14],))
    saves.plan(again, computed_after=5 * BS)
    assert len(s.stores) == 4                                              # only block 0 was new
    hybrid = RequestState(request(6, 2), block_ids=([20, 21], [NULL_BLOCK, 22]))
    saves.plan(hybrid, computed_after=2 * BS)
    assert [op.block_hashes for op in s.stores.values()][-1] == hybrid.request.block_hashes[1:2]


def test_loads_plan_pieces_pin_their_chunks_and_release_them(tmp_path):
    s = store(tmp_path, host_chunks=4)
    loads = LoadPlanner(s, BS, blocking=False, loads_by_request=False)
    req = request(7, 4)
    on_host, on_disk = chunk(7), Chunk(req.block_hashes[3], req.block_hashes[2:4], 2 * BLOCK_BYTES)
    s.admit(on_host, HOST)
    s.add(on_host)
    s.admit(on_disk, DISK)
    s.add(on_disk)
    st = RequestState(req)
    assert loads.lookup(st, 0) == (4 * BS, True)        # two blocks on disk: in the background
    loads.plan(st, ([40, 41, 42, 43],), 4 * BS)
    (op,) = loads.loads
    assert op.is_async and [(p.tier, p.rows) for p in op.pieces] == [(HOST, 2), (DISK, 2)]
    assert on_host.pins == on_disk.pins == 1 and st.load == (0, {40, 41, 42, 43})
    assert loads.tokens_by_tier("r7") == {HOST: 2 * BS, DISK: 2 * BS}
    loads.plan_promotions()                              # the disk chunk goes back into host memory too
    assert op.pieces[1].promote_to_host and on_disk.key in s.host.lru
    loads.take_step()
    assert on_host.pins == 1                             # an async load keeps its pins until it is done
    loads.recomputed({"r7": st}, set(), {42})            # its third block failed: saved again from block 0
    assert st.load is None and st.saved_upto == 0
    loads.finished("r7", st)
    assert on_host.pins == on_disk.pins == 0 and HOST in on_disk.tiers
    host_only = RequestState(request(7, 3))
    assert loads.lookup(host_only, 0) == (3 * BS, False)           # all in host memory now: in the forward pass
    loads.plan(host_only, ([50, 51, 52],), 3 * BS)
    zero = SimpleNamespace(new_block_ids_to_zero=[50, 51, 52, 53])
    loads.skip_zeroing(zero)
    assert zero.new_block_ids_to_zero == [53]                      # blocks the load overwrites whole
    loads.take_step()
    assert on_host.pins == 0                                       # a synchronous load unpins at once


def test_a_prefix_from_vllms_cache_is_not_stored_again_but_counts_as_used(tmp_path):
    s = store(tmp_path, host_chunks=2, disk=False)
    loads = LoadPlanner(s, BS, blocking=False, loads_by_request=False)
    saves = SavePlanner(KVReelConfig.load(env={"KVREEL_CHUNK_TOKENS": str(2 * BS)}), s, BS, BLOCK_BYTES,
                        remote=False)
    req = request(8, 6)
    held, other = chunk(8), chunk(9)            # kvreel holds blocks 0-1 of the prefix; blocks 2-3 it evicted
    for c in (held, other):
        s.admit(c, HOST)
        s.add(c)
    st = RequestState(req, block_ids=([60, 61, 62, 63, 64, 65],))
    assert loads.lookup(st, 4 * BS) == (0, False)       # vLLM's cache has blocks 0-3: nothing to load
    assert st.saved_upto == st.cached_blocks == 4
    assert list(s.host.lru) == [other.key, held.key]    # the held chunk of that prefix was used just now
    saves.plan(st, computed_after=6 * BS)
    assert [op.block_hashes for op in s.stores.values()] == [req.block_hashes[4:6]]     # only what it computed
    assert s.evictions[HOST] == [other.key]             # room made from the chunk not used lately
