"""Scheduler side of the connector: vLLM's scheduler-side hooks, over

* ``chunks``: the index of every stored chunk and the local tiers' budgets and
  eviction (LRU, or by agent-workflow distance);
* ``loads``: prefix lookups and the loads planned into vLLM's blocks;
* ``saves``: the blocks each step stores, and where;
* ``prefetch``: chunks of the agents about to run, read into host memory
  ahead (with ``KVREEL_EVICTION=workflow``);
* ``events``: chunks entering and leaving tiers as vLLM's KV events;
* the history plan of long sessions (``kvreel.scheduler.history_plan``).

Each step's saves, loads, deletions, history appends and prefetches go to the
workers in one ``KVReelMetadata``."""

from __future__ import annotations

import logging

from kvreel.codec.formats import ChunkError
from kvreel.connector.config import KVReelConfig, format_bytes
from kvreel.connector.metadata import GroupBlockIds, KVReelMetadata, KVReelWorkerMeta
from kvreel.connector.stats import KVReelStats
from kvreel.connector.tiers import Tier
from kvreel.connector.tiers.disk import scan_chunk_files
from kvreel.connector.tiers.specs import tier_specs
from kvreel.scheduler.chunks import DISK, HOST, Chunk, ChunkStore
from kvreel.scheduler.events import TierEvents
from kvreel.scheduler.eviction import policy_for
from kvreel.scheduler.loads import LoadPlanner
from kvreel.scheduler.prefetch import Prefetcher
from kvreel.scheduler.requests import RequestState
from kvreel.scheduler.saves import SavePlanner
from kvreel.scheduler.workflow import WorkflowTracker

logger = logging.getLogger(__name__)
WRITE_FAILURES = {DISK: "disk_write_failures", Tier.REMOTE: "remote_upload_failures"}   # counter per tier
__all__ = ["Chunk", "KVReelScheduler"]


class KVReelScheduler:
    def __init__(self, cfg: KVReelConfig, identity: str, block_size: int, bytes_per_block: int,
                 workers: int = 1, groups: int = 1, kv_events: bool = False,
                 history_bytes_per_block: int | None = None):
        if cfg.chunk_tokens % block_size:
            raise ValueError(f"KVREEL_CHUNK_TOKENS={cfg.chunk_tokens} must be a multiple of the engine's "
                             f"block size ({block_size})")
        self.cfg, self.identity, self.block_size, self.bytes_per_block = cfg, identity, block_size, bytes_per_block
        self.history_bytes_per_block = history_bytes_per_block or bytes_per_block    # retrieval's history, held
        self.stats = KVReelStats()
        self.reqs: dict[str, RequestState] = {}
        self.workflows = WorkflowTracker() if cfg.eviction == "workflow" else None
        self.prefetch: Prefetcher | None = None
        self.tiers = tier_specs(cfg, identity)
        self.policy = policy_for(self._steps if self.workflows is not None else None)
        self.store = ChunkStore(self.stats, [s.scheduler_half(self.policy) for s in self.tiers.values() if s.local],
                                TierEvents(block_size) if kv_events else None)
        self.remote = self.tiers[Tier.REMOTE].scheduler_half() if Tier.REMOTE in self.tiers else None
        self.history = None
        if cfg.retrieval != "off":
            from kvreel.scheduler.history_plan import HistoryPlanner
            self.history = HistoryPlanner(block_size, cfg.retrieval_window, cfg.retrieval_min_tokens)
        self._history_bytes = 0
        self._history_reported = 0                  # what the workers last said their histories take
        self._warned_history_over_host = False
        if self.workflows is not None:
            self.prefetch = Prefetcher(cfg, self.store, self.workflows, block_size, workers, self.remote is not None)
        # vLLM maps failed block ids back to requests only with one KV cache group;
        # with more, every load is asynchronous and a failure is reported per request
        self.loads = LoadPlanner(self.store, block_size, cfg.fetch_mode == "blocking", groups > 1,
                                 self.remote, self.history)
        self.saves = SavePlanner(cfg, self.store, block_size, bytes_per_block, self.remote is not None,
                                 self.history)
        if DISK in self.store.budgets:
            self._adopt_disk_chunks()
        logger.info("kvreel: host tier %s, disk tier %s, chunk %d tokens, %s per block",
                    format_bytes(cfg.cpu_bytes),
                    f"{cfg.disk_dir} ({format_bytes(cfg.disk_bytes)}, {len(self.store.budgets[DISK].lru)} chunks "
                    "found)" if DISK in self.store.budgets else "off", cfg.chunk_tokens, format_bytes(bytes_per_block))

    @property
    def host(self):
        return self.store.host

    def _steps(self, chunk: Chunk) -> float:
        return self.prefetch.steps(chunk)

    def _adopt_disk_chunks(self) -> None:
        found = []
        for key, path, header in scan_chunk_files(self.cfg.disk_dir, self.identity):
            if isinstance(header, ChunkError):
                self.stats.add("corrupt_chunks", label=DISK)
                logger.warning("kvreel: ignoring unusable chunk file: %s", header)
                continue
            if header.shape[1] != len(header.block_hashes) or header.payload_bytes != \
                    len(header.block_hashes) * self.bytes_per_block:
                self.stats.add("corrupt_chunks", label=DISK)
                logger.warning("kvreel: ignoring chunk %s: its shape %s does not match this engine's layout",
                               key.hex()[:16], header.shape)
                continue
            found.append((path.stat().st_mtime, key, header))
        for _, key, header in sorted(found):
            held = self.store.by_key(key)
            if held is not None:                            # in host memory still (the disk came back)
                if DISK not in held.tiers:
                    self.store.admit(held, DISK)
                continue
            chunk = Chunk(key, list(header.block_hashes), header.payload_bytes)
            if self.store.admit(chunk, DISK):
                self.store.add(chunk)

    # -- vLLM's hooks ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self.reqs.setdefault(request.request_id, RequestState(request))
        st.request = request
        if self.workflows is not None and st.user is None:
            st.user = self.workflows.on_request(request.request_id, getattr(request, "kv_transfer_params", None))
        return self.loads.lookup(st, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids: GroupBlockIds, num_external_tokens: int) -> None:
        st = self.reqs.setdefault(request.request_id, RequestState(request))
        self.loads.plan(st, block_ids, num_external_tokens)

    def planned_tokens_by_tier(self, req_id: str) -> dict[Tier, int]:
        return self.loads.tokens_by_tier(req_id)

    def build_connector_meta(self, scheduler_output) -> KVReelMetadata:
        self.loads.begin_step(self.reqs)
        if self.remote is not None:
            self.remote.new_step()
        for new in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.block_ids = tuple(list(ids) for ids in new.block_ids)
                self.saves.plan(st, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = tuple(list(ids or ()) for ids in new_ids) if new_ids else ()
            elif new_ids:
                st.block_ids = st.block_ids or tuple([] for _ in new_ids)
                for mine, ids in zip(st.block_ids, new_ids):
                    mine += ids or ()
            self.saves.plan(st, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        self._account_histories()
        self.loads.plan_promotions()
        written = self._written_blocks(scheduler_output)
        self.loads.skip_zeroing(scheduler_output)
        prefetches = self.prefetch.plan() if self.prefetch is not None else []
        stores, evictions = self.store.take_step()
        return KVReelMetadata(self.loads.take_step(), stores, evictions,
                              self.history.take_step() if self.history is not None else None, prefetches, written)

    def _written_blocks(self, scheduler_output) -> set[int]:
        """Every block the step may write: those vLLM zeroes, those it gave a
        request this step (fresh, or freed by another) and those kvreel loads
        into; not the prefix blocks a request found in vLLM's cache, which it
        only reads. A save still copying one of them must finish first (the
        worker's ``before_writes``)."""
        written = set(scheduler_output.new_block_ids_to_zero or ())
        for new in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            for ids in new.block_ids:
                written.update(ids[st.cached_blocks if st else 0:])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            resumed = req_id in cached.resumed_req_ids
            for ids in cached.new_block_ids[i] or ():
                written.update((ids or ())[st.cached_blocks if resumed and st else 0:])
        written.update(b for op in self.loads.loads for p in op.pieces for ids in p.block_ids for b in ids)
        return written

    def _account_histories(self) -> None:
        """Offloaded histories live in the worker's host memory, beside the host
        tier: charge them to its byte budget, so a growing session pushes the
        least recently used chunks out of host memory (their disk copies stay)
        and new chunks go to the disk tier only. A live history is never dropped:
        past the budget kvreel says so once and holds it anyway. The charge is
        what the planned blocks hold, or what the workers last reported their
        histories take where that is more (the room reserved to grow into and
        the clusters' key sums, which only the worker sees)."""
        if self.history is None or self.cfg.cpu_bytes <= 0:
            return
        want = max(sum(self.history.planned.values()) * self.history_bytes_per_block, self._history_reported)
        grow = want - self._history_bytes
        if grow > 0:
            victims = self.host.victims_for(grow)
            if victims is None:
                victims = [c for c in self.host.lru.values() if c.pins == 0]
                if not self._warned_history_over_host:
                    self._warned_history_over_host = True
                    logger.warning("kvreel: long sessions' histories (%s) exceed KVREEL_CPU_BYTES (%s); "
                                   "host memory grows past it", format_bytes(want), format_bytes(self.cfg.cpu_bytes))
            for victim in victims:
                self.store.evict(victim, HOST)
        self.store.charge(HOST, grow)
        self._history_bytes = want

    def update_connector_output(self, output) -> None:
        if self.history is not None:
            self.history.confirm()
        if output.failed_recving or output.invalid_block_ids:
            self.loads.recomputed(self.reqs, set(output.failed_recving or ()), set(output.invalid_block_ids or ()))
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVReelWorkerMeta):
            for tier, why in meta.tiers_off.items():
                if tier in self.store.budgets:
                    logger.error("kvreel: %s tier off on a worker: %s", tier.value, why)
                    self.store.turn_off(tier)
            if DISK in meta.tiers_back and DISK in self.tiers and DISK not in self.store.budgets:
                self.store.turn_on(self.tiers[DISK].scheduler_half(self.policy))
                self._adopt_disk_chunks()
                logger.warning("kvreel: disk tier back on (%d chunk files adopted)", len(self.store.budgets[DISK].lru))
            for tier, keys in meta.failed_writes.items():
                self.stats.add(WRITE_FAILURES[tier], len(keys))
                if tier == Tier.REMOTE and self.store.events is not None:
                    for key in keys:     # announced when planned
                        self.store.events.upload_failed(key)
                for key in keys if tier in self.store.budgets else ():
                    chunk = self.store.by_key(key)
                    if chunk is not None and tier in chunk.tiers:
                        self.store.drop_copy(chunk, tier)
            for key in meta.bad_keys:
                self.store.drop(key)
            if meta.history_bytes is not None:
                self._history_reported = meta.history_bytes
            if self.prefetch is not None:
                for key, n in meta.prefetched.items():
                    self.prefetch.landed(key, n)
                for key in meta.prefetch_failed:
                    self.prefetch.done(key, False)
        for req_id in output.finished_recving or ():
            self.loads.finished(req_id, self.reqs.get(req_id))

    def request_finished(self, request) -> None:
        st = self.reqs.pop(request.request_id, None)
        if self.workflows is not None:
            if st is not None and st.user is not None:
                self.prefetch.remember_prompt(st)
            self.workflows.on_finished(request.request_id)
        if self.history is not None:
            self.history.forget(request.request_id)
        if self.remote is not None:
            self.remote.forget(request.request_id)

    def reset(self) -> bool:
        """Forget every unpinned chunk in every tier (``reset_prefix_cache(reset_connector=True)``)."""
        self.store.reset()
        return True

    def take_events(self) -> list:
        """KV events of chunks that entered or left a tier since the last call."""
        return self.store.events.take() if self.store.events is not None else []

    def take_stats(self) -> KVReelStats | None:
        return self.stats.take()
