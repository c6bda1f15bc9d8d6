"""What kvreel's scheduler side stores again after a failed load, outside an
engine: vLLM reuses block ids, so a failure names a block of a load in flight,
and a long request's blocks that vLLM freed are never read back for a store
(the soak found both as wrong KV stored under a shared prefix's hashes)."""

from __future__ import annotations

from types import SimpleNamespace

from scheduler_stand_ins import new_request, scheduler_output, worker_said

BS = 32


def make_scheduler(tmp_path, **env):
    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.scheduler_side import KVReelScheduler
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
