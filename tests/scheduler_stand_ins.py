"""What vLLM's scheduler hands kvreel's scheduler side, for tests that drive it
outside an engine: a SchedulerOutput with the fields the connector reads, and
vLLM's own KVConnectorOutput for what the workers said."""

from __future__ import annotations

from types import SimpleNamespace


def scheduler_output(new=(), cached=(), tokens=None):
    """``new``: vLLM's NewRequestData-like (req_id, block_ids, num_computed_tokens);
    ``cached``: (request, new block ids of group 0, computed tokens); ``tokens``:
    request id -> tokens scheduled this step."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new), num_scheduled_tokens=tokens or {},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r, _, _ in cached],
                                              new_block_ids=[(ids,) for _, ids, _ in cached],
                                              num_computed_tokens=[done for _, _, done in cached],
                                              resumed_req_ids=set()),
        new_block_ids_to_zero=None)


def new_request(request, block_ids: list[int], computed: int):
    """A newly scheduled request as vLLM's SchedulerOutput lists it (one KV cache group)."""
    return SimpleNamespace(req_id=request.request_id, block_ids=(block_ids,), num_computed_tokens=computed)


def worker_said(sched, finished=(), invalid_block_ids=(), **meta):
    """The step's KVConnectorOutput: finished loads, failed blocks, kvreel's worker meta."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvreel.connector.metadata import KVReelWorkerMeta
    sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=KVReelWorkerMeta(**meta) if meta else None,
        finished_recving=set(finished), invalid_block_ids=set(invalid_block_ids)))
