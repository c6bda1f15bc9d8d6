"""Agent workflows (KVFlow): hints, steps-to-execution, eviction order and
prefetch plans in kvreel's scheduler side; the end-to-end run in vLLM is in
test_workflow_vllm.py."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from kvreel.codec.formats import chunk_key
from kvreel.connector.config import KVReelConfig
from kvreel.scheduler.kvreel_scheduler import KVReelScheduler
from kvreel.connector.tiers import Tier
from kvreel.scheduler.workflow import FAR, HintError, Workflow, WorkflowTracker
from scheduler_stand_ins import new_request, scheduler_output, worker_said

LOOP = {"A": ["B"], "B": ["C"], "C": ["D"], "D": ["A"]}
BS = 32                     # tokens per block; one 2-block chunk per agent prefix
CHUNK = 2 * 1024


def test_steps_to_execution_follow_the_graph():
    wf = Workflow("w", {"plan": ["code"], "code": ["test", "plan"], "test": ["code"], "idle": []})
    tr = WorkflowTracker()
    assert tr.on_request("r1", wf.hints("code")) == ("w", "code")
    assert [tr.steps(("w", a)) for a in ("code", "test", "plan", "idle")] == [0, 1, 1, FAR]
    tr.on_finished("r1")                       # code done: its next run is two steps away (via test or plan)
    assert [tr.steps(("w", a)) for a in ("code", "test", "plan")] == [2, 1, 1]
    assert tr.upcoming(1) == [(("w", "test"), 1), (("w", "plan"), 1)]
    tr.on_request("r2", wf.hints("plan"))
    assert tr.steps(("w", "code")) == 1 and tr.steps(("w", "plan")) == 0
    late = {"kvreel": {"workflow": "w", "agent": "test", "step": 1, "graph": wf.graph}}
    tr.on_request("r0", late)                  # an older step arriving late moves nothing
    assert tr.steps(("w", "plan")) == 0
    assert tr.on_request("plain", None) is None and tr.on_request("other", {"do_remote_decode": True}) is None


@pytest.mark.parametrize("hints, why", [
    ({"workflow": "w", "agent": "Z", "graph": LOOP}, "not in workflow"),
    ({"workflow": "w", "agent": "A", "graph": {"A": ["nobody"]}}, "does not define"),
    ({"workflow": "w", "agent": "A", "graph": {f"a{i}": [] for i in range(300)} | {"A": []}}, "1-256 agents"),
    ({"workflow": "w", "agent": "A", "graph": {"A": "B"}}, "must be a list"),
    ({"workflow": "x" * 500, "agent": "A", "graph": LOOP}, "1-128 characters"),
    ({"workflow": "new", "agent": "A"}, "no graph yet"),
    ({"workflow": "w", "agent": "A", "graph": LOOP, "step": -3}, "non-negative"),
    ("not an object", "must be an object"),
])
def test_bad_hints_are_ignored_with_a_log_line(hints, why, caplog):
    tr = WorkflowTracker()
    with caplog.at_level(logging.WARNING, logger="kvreel.scheduler.workflow"):
        assert tr.on_request("r", {"kvreel": hints}) is None
    assert why in caplog.text and tr.ignored == 1
    with pytest.raises(HintError):
        Workflow("w", {"A": ["nobody"]})


def make_scheduler(tmp_path, **env):
    cfg = KVReelConfig.load(env={"KVREEL_CPU_BYTES": str(3 * CHUNK), "KVREEL_DISK_DIR": str(tmp_path),
                                 "KVREEL_CHUNK_TOKENS": str(2 * BS), **env})
    return KVReelScheduler(cfg, "model", block_size=BS, bytes_per_block=1024)


def agent_blocks(agent):
    """The block hashes of ``agent``'s two-block prefix (one chunk)."""
    return [bytes([ord(agent), j]) * 16 for j in range(2)]


def agent_request(req_id, agent, wf=None):
    """A request whose prompt is ``agent``'s two-block prefix plus a partial block."""
    return SimpleNamespace(request_id=req_id, block_hashes=agent_blocks(agent),
                           num_tokens=2 * BS + 5, kv_transfer_params=wf.hints(agent) if wf else None)


def step(sched, req_id, agent, wf=None):
    """One request of ``agent`` through the scheduler side as vLLM drives it:
    lookup, allocation, the step that computes (and saves) it, finish. Returns
    the tier its prefix came from and the step's plan."""
    request = agent_request(req_id, agent, wf)
    deadline = time.monotonic() + 10
    while (matched := sched.get_num_new_matched_tokens(request, 0)[0]) is None:   # a remote lookup in flight
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sched.update_state_after_alloc(request, ([10, 11, 12],), matched)
    tiers = sched.planned_tokens_by_tier(req_id)
    meta = sched.build_connector_meta(scheduler_output([new_request(request, [10, 11, 12], matched)],
                                                       tokens={req_id: 2 * BS + 5 - matched}))
    worker_said(sched, finished=[req_id])
    sched.request_finished(request)
    return (max(tiers, key=tiers.get) if tiers else None), meta


def test_workflow_eviction_keeps_the_agents_that_run_next(tmp_path):
    """Four agents in a loop, host memory for three prefixes: LRU always evicts
    the prefix that runs next; steps-to-execution evicts the furthest."""
    def second_round(policy, hinted):
        sched = make_scheduler(tmp_path / policy, KVREEL_EVICTION=policy, KVREEL_PREFETCH_DEPTH="0")
        wf = Workflow("w", LOOP) if hinted else None
        for i, agent in enumerate("ABCD"):
            assert step(sched, f"{policy}{i}", agent, wf)[0] is None     # first round: computed
        return [step(sched, f"{policy}{i}b", agent, wf)[0] for i, agent in enumerate("ABCD")]
    assert second_round("lru", True) == [Tier.DISK] * 4
    assert second_round("workflow", False) == [Tier.DISK] * 4           # no hints: exactly LRU
    # D's admission evicted C (3 steps away); C comes back from disk and evicts B (then 3 steps away)
    assert second_round("workflow", True) == [Tier.HOST, Tier.HOST, Tier.DISK, Tier.HOST]


def test_unhinted_chunks_never_push_out_an_agent_about_to_run(tmp_path):
    sched = make_scheduler(tmp_path, KVREEL_PREFETCH_DEPTH="0")
    wf = Workflow("w", LOOP)
    for i, agent in enumerate("AB"):
        step(sched, f"r{i}", agent, wf)
    for i, agent in enumerate("xyz"):                                   # unhinted traffic: LRU among itself
        step(sched, f"u{i}", agent)
    assert step(sched, "r2", "C", wf)[0] is None
    assert step(sched, "r3", "D", wf)[0] is None
    assert step(sched, "r4", "A", wf)[0] == Tier.HOST


def test_prefetch_brings_the_next_agents_prefix_into_host_memory(tmp_path):
    sched = make_scheduler(tmp_path, KVREEL_PREFETCH_DEPTH="1")
    wf = Workflow("w", LOOP)
    for i, agent in enumerate("ABCD"):
        step(sched, f"r{i}", agent, wf)
    # D ran last; host holds A, B, D (C, furthest, was evicted). While A runs, B is
    # one step away and already in host memory; nothing to prefetch.
    _, meta = step(sched, "r4", "A", wf)
    assert meta.prefetches == []
    # while B runs, C (one step away, on disk only) is prefetched into room held by a further chunk
    request = agent_request("r5", "B", wf)
    sched.get_num_new_matched_tokens(request, 0)
    c_key, c_block = chunk_key(agent_blocks("C")), agent_blocks("C")[-1]
    assert sched.build_connector_meta(scheduler_output()).prefetches == [(c_key, Tier.DISK)]
    assert sched.build_connector_meta(scheduler_output()).prefetches == []     # issued once
    assert Tier.HOST not in sched.store.holder(c_block).tiers                 # not offered before it has landed
    worker_said(sched, prefetched={c_key: 1})
    assert Tier.HOST in sched.store.holder(c_block).tiers
    sched.request_finished(request)
    assert step(sched, "r6", "C", wf)[0] == Tier.HOST
    counts = sched.take_stats().data
    assert counts["prefetches|issued"] == 1 and counts["prefetches|used"] == 1


def test_a_failed_prefetch_releases_its_room(tmp_path):
    sched = make_scheduler(tmp_path, KVREEL_PREFETCH_DEPTH="2")
    wf = Workflow("w", LOOP)
    for i, agent in enumerate("ABCD"):
        step(sched, f"r{i}", agent, wf)
    _, meta = step(sched, "r4", "A", wf)             # A ran: B, C within two steps; C on disk only
    c_key, c_block = chunk_key(agent_blocks("C")), agent_blocks("C")[-1]
    assert meta.prefetches == [(c_key, Tier.DISK)]
    used = sched.host.used
    worker_said(sched, prefetch_failed={c_key})
    assert sched.host.used == used - CHUNK and c_key not in sched.host.lru
    assert sched.store.holder(c_block).pins == 0
    assert sched.take_stats().data["prefetches|failed"] == 1


def test_a_chunk_gone_from_every_local_tier_is_prefetched_from_the_remote_store(tmp_path):
    """Host memory and the remote store only: a chunk evicted from host memory is
    forgotten locally, and fetched back from the store before its agent runs."""
    cfg = KVReelConfig.load(env={"KVREEL_CPU_BYTES": str(3 * CHUNK), "KVREEL_CHUNK_TOKENS": str(2 * BS),
                                 "KVREEL_REMOTE_URL": f"file://{tmp_path}", "KVREEL_PREFETCH_DEPTH": "2"})
    sched = KVReelScheduler(cfg, "model", block_size=BS, bytes_per_block=1024)
    wf = Workflow("w", LOOP)
    for i, agent in enumerate("ABCD"):                 # remote lookups find nothing: computed
        step(sched, f"r{i}", agent, wf)
    c_key, c_block = chunk_key(agent_blocks("C")), agent_blocks("C")[-1]
    assert c_block not in sched.store.index                    # D's admission evicted C: in the store only
    sched.get_num_new_matched_tokens(agent_request("r4", "A", wf), 0)
    assert sched.build_connector_meta(scheduler_output()).prefetches == [(c_key, Tier.REMOTE)]
    worker_said(sched, prefetched={c_key: 1})
    assert sched.store.holder(c_block).tiers == {Tier.HOST}   # indexed again, in host memory
    sched.remote.close()
