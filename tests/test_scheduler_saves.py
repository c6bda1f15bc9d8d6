"""What kvreel's scheduler side stores, outside an engine: again after a failed
load (vLLM reuses block ids, so a failure names a block of a load in flight),
never a long request's blocks that vLLM freed (the soak found both as wrong KV
stored under a shared prefix's hashes), and chunks cut differently by two
engines sharing a remote store, each under a key of its own."""

from __future__ import annotations

from types import SimpleNamespace

from scheduler_stand_ins import new_request, scheduler_output, worker_said

BS = 32


def make_scheduler(tmp_path, **env):
    from kvreel.connector.config import KVReelConfig
    from kvreel.scheduler.kvreel_scheduler import KVReelScheduler
    cfg = KVReelConfig.load(env={"KVREEL_CPU_BYTES": "1MiB", "KVREEL_DISK_DIR": str(tmp_path),
                                 "KVREEL_CHUNK_TOKENS": str(2 * BS), **env})
    return KVReelScheduler(cfg, "model", block_size=BS, bytes_per_block=1024)


def request(req_id: str, prefix: int, blocks: int):
    return SimpleNamespace(request_id=req_id, block_hashes=[bytes([prefix, j]) * 16 for j in range(blocks)],
                           num_tokens=blocks * BS + 5, num_prompt_tokens=blocks * BS + 5, max_tokens=16)


def stored_blocks(meta) -> list[list[int]]:
    return [op.block_ids[0] for op in meta.stores]


def test_a_failure_names_blocks_of_a_load_in_flight_not_of_one_done(tmp_path):
    sched = make_scheduler(tmp_path)
    first = request("first", 1, 2)
    sched.get_num_new_matched_tokens(first, 0)
    sched.build_connector_meta(scheduler_output([new_request(first, [10, 11, 12], 0)], tokens={"first": 2 * BS + 5}))
    sched.request_finished(first)                     # its chunk is in the host tier now
    again = request("again", 1, 2)
    assert sched.get_num_new_matched_tokens(again, 0)[0] == 2 * BS
    sched.update_state_after_alloc(again, ([20, 21, 22],), 2 * BS)
    sched.build_connector_meta(scheduler_output([new_request(again, [20, 21, 22], 2 * BS)], tokens={"again": 5}))
    worker_said(sched)                                # its synchronous load went well
    sched.build_connector_meta(scheduler_output(cached=[(again, [], 2 * BS + 5)], tokens={"again": 1}))
    worker_said(sched, invalid_block_ids={21})        # block 21 is another request's now
    assert sched.reqs["again"].saved_upto == 2


def test_a_failure_in_the_same_step_is_stored_again(tmp_path):
    sched = make_scheduler(tmp_path)
    first = request("first", 1, 2)
    sched.get_num_new_matched_tokens(first, 0)
    sched.build_connector_meta(scheduler_output([new_request(first, [10, 11, 12], 0)], tokens={"first": 2 * BS + 5}))
    sched.request_finished(first)
    again = request("again", 1, 2)
    sched.get_num_new_matched_tokens(again, 0)
    sched.update_state_after_alloc(again, ([20, 21, 22],), 2 * BS)
    sched.build_connector_meta(scheduler_output([new_request(again, [20, 21, 22], 2 * BS)], tokens={"again": 5}))
    worker_said(sched, invalid_block_ids={21})        # the load of this step failed: vLLM recomputes
    assert sched.reqs["again"].saved_upto == 0


def test_blocks_vllm_freed_are_never_read_for_a_store(tmp_path):
    from kvreel.connector.retrieval.offload import LEDGER
    sched = make_scheduler(tmp_path, KVREEL_RETRIEVAL="resv", KVREEL_RETRIEVAL_MIN_TOKENS="64",
                           KVREEL_RETRIEVAL_WINDOW="64", KVREEL_CHUNK_TOKENS=str(BS))
    long = request("long", 3, 6)
    sched.get_num_new_matched_tokens(long, 0)
    LEDGER.hold("long", 4)                            # kvreel holds blocks 0-3: vLLM freed them
    try:
        sched.reqs["long"].saved_upto = 0             # as after a failed load
        meta = sched.build_connector_meta(scheduler_output([new_request(long, [30, 31, 32, 33, 34, 35, 36], 0)],
                                                    tokens={"long": 6 * BS + 5}))
        assert stored_blocks(meta) == [[34], [35]]
    finally:
        LEDGER.release("long")


def test_a_step_names_every_block_it_writes_and_none_it_only_reads(tmp_path):
    """The worker copies a step's saves while the next step runs, until that
    step writes one of their blocks: the scheduler names them all."""
    sched = make_scheduler(tmp_path)
    first, other = request("first", 1, 4), request("other", 2, 1)
    for r in (first, other):
        sched.get_num_new_matched_tokens(r, 0)
    meta = sched.build_connector_meta(scheduler_output(
        [new_request(first, [10, 11, 12, 13, 14], 0), new_request(other, [30, 31], 0)],
        tokens={"first": 4 * BS + 5, "other": BS + 5}))
    assert meta.written_blocks == {10, 11, 12, 13, 14, 30, 31}
    assert stored_blocks(meta) == [[10, 11], [12, 13], [30]]
    sched.request_finished(first)
    again = request("again", 1, 4)                    # blocks 0-1 in vLLM's cache, 2-3 loaded from kvreel's host tier
    assert sched.get_num_new_matched_tokens(again, 2 * BS) == (2 * BS, False)
    sched.update_state_after_alloc(again, ([10, 11, 22, 23, 24],), 2 * BS)
    step = scheduler_output([new_request(again, [10, 11, 22, 23, 24], 4 * BS)],
                            cached=[(other, [40], BS + 5)], tokens={"again": 5, "other": 1})
    step.new_block_ids_to_zero = [24, 40]
    meta = sched.build_connector_meta(step)
    assert meta.written_blocks == {22, 23, 24, 40}    # not 10, 11: read from vLLM's cache, never written
    assert [p.block_ids[0] for op in meta.loads for p in op.pieces] == [[22, 23]]


def test_engines_that_cut_a_chunk_differently_never_overwrite_each_other_in_the_store(tmp_path):
    """Engine A computes blocks 0-3 (one chunk); engine B's own prefix cache held
    blocks 0-1, so B stores only blocks 2-3. Both upload to one store. A third
    engine must get each block's own KV back through the store's pointers (when
    a chunk's key was its last block's hash, B's chunk replaced A's and block
    0's pointer led to block 2's KV)."""
    import torch

    from kvreel.codec.forms import StoredForms
    from kvreel.connector.tiers.remote import RemoteTier
    from kvreel.scheduler.remote_lookups import RemoteLookups
    url = f"file://{tmp_path / 'store'}"
    tier = RemoteTier(url, StoredForms("model"), 2.0, 8)
    blocks = 4
    for name, hit in (("A", 0), ("B", 2)):
        sched = make_scheduler(tmp_path / name, KVREEL_CHUNK_TOKENS=str(blocks * BS), KVREEL_REMOTE_URL=url)
        req = request(name, 7, blocks)
        req.all_token_ids = list(range(req.num_tokens))
        sched.get_num_new_matched_tokens(req, hit * BS)              # vLLM's own hit: `hit` blocks
        meta = sched.build_connector_meta(scheduler_output(
            [new_request(req, list(range(10, 10 + blocks + 1)), hit * BS)], tokens={name: req.num_tokens - hit * BS}))
        [op] = meta.stores
        assert len(op.block_hashes) == blocks - hit
        first = blocks - len(op.block_hashes)
        rows = torch.arange(first, blocks, dtype=torch.uint8)         # each row holds its block's number
        assert tier.put(op.key, op.block_hashes, rows.view(1, -1, 1).expand(1, -1, 64).contiguous())
        assert tier.flush(60)
        sched.remote.close()
    lookups = RemoteLookups(url, "model", 2.0, wait_s=10)
    pointers = lookups.poll("C", request("C", 7, blocks).block_hashes)
    assert len(pointers) == blocks
    for block, (key, row) in enumerate(pointers):
        assert int(tier.get(key)[0, row, 0]) == block
    lookups.close()
    tier.close()


def test_blocks_the_store_failed_to_serve_are_uploaded_again_once_recomputed(tmp_path):
    """A remote load failed (a damaged or refused chunk, which the fetch deleted):
    vLLM recomputes the blocks, and kvreel stores them in the store again
    (blocks that did load from the store are not uploaded back)."""
    import torch

    from kvreel.codec.formats import chunk_key
    from kvreel.codec.forms import StoredForms
    from kvreel.connector.tiers import Tier
    from kvreel.connector.tiers.remote import RemoteTier
    url = f"file://{tmp_path / 'store'}"
    req = request("r", 7, 2)
    tier = RemoteTier(url, StoredForms("model"), 2.0, 8)
    assert tier.put(chunk_key(req.block_hashes), req.block_hashes, torch.zeros(1, 2, 64, dtype=torch.uint8))
    assert tier.flush(60)
    tier.close()
    sched = make_scheduler(tmp_path / "local", KVREEL_REMOTE_URL=url, KVREEL_REMOTE_LOOKUP_WAIT_MS="1000")
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    sched.update_state_after_alloc(req, ([10, 11, 12],), 2 * BS)
    meta = sched.build_connector_meta(scheduler_output([new_request(req, [10, 11, 12], 0)], tokens={"r": 0}))
    assert [p.tier for op in meta.loads for p in op.pieces] == [Tier.REMOTE]
    worker_said(sched, invalid_block_ids={10})                   # the fetch failed: vLLM recomputes from block 0
    meta = sched.build_connector_meta(scheduler_output(cached=[(req, [], 0)], tokens={"r": 2 * BS + 5}))
    assert [(op.block_hashes, Tier.REMOTE in op.tiers) for op in meta.stores] == [(req.block_hashes, True)]
    sched.remote.close()
