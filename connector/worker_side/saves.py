"""The worker's saves: a step's chunks copied out of vLLM's pages into the tiers
the scheduler chose, at once on CUDA (a side stream in ``block_copy``) or, on a
CPU engine, on a save thread beside the model's cores while the next step
runs, until that step writes a block a save still reads (``before_writes``)."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvreel.connector.metadata import KVReelMetadata, StoreOp
from kvreel.connector.tiers import ChunkTier, Tier
from kvreel.connector.worker_side.block_copy import PagedRegions
from kvreel.connector.worker_side.reports import WorkerReports

logger = logging.getLogger(__name__)


class PageSaver:
    def __init__(self, pages: PagedRegions, tiers: dict[Tier, ChunkTier], reports: WorkerReports, on_thread: bool):
        self.pages, self.tiers, self.reports = pages, tiers, reports      # ``tiers``: the worker's, those on
        self.on_thread = on_thread
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreel-save",
                                         initializer=run_beside_the_model) if on_thread else None
        self._saving: list[_SaveJob] = []

    def save(self, stores: list[StoreOp]) -> None:
        """Store the step's chunks: at once, or on the save thread."""
        if not stores:
            return
        if self._saver is None:
            self._save(stores)
            return
        blocks = {b for op in stores for ids in op.block_ids for b in ids}
        self._wait_for(lambda job: job.future.done())          # forget those done (raising their bugs)
        self._saving.append(_SaveJob(blocks, {op.key for op in stores}, self._saver.submit(self._save, stores)))

    def _save(self, stores: list[StoreOp]) -> None:
        for op in stores:
            t0 = time.perf_counter()
            data = self.pages.gather(op.block_ids)
            for kind in op.tiers:
                if (tier := self.tiers.get(kind)) is not None:
                    tier.put(op.key, op.block_hashes, data)
            self.reports.count("save_seconds", time.perf_counter() - t0)
            self.reports.count("save_count")

    def before_writes(self, meta: KVReelMetadata) -> None:
        """vLLM's ``handle_preemptions``, before a step writes any block: saves
        still copying blocks this step overwrites (freed and given to another
        request, zeroed, or loaded into) finish first."""
        self._wait_for(lambda job: not job.blocks.isdisjoint(meta.written_blocks))

    def before_reads(self, meta: KVReelMetadata) -> None:
        """Saves of the chunks this step loads, deletes or prefetches are done first
        (their keys gathered only while a save is pending: most steps have none)."""
        if not self._saving:
            return
        keys = {*(key for keys in meta.evictions.values() for key in keys), *(key for key, _ in meta.prefetches),
                *(p.key for op in meta.loads for p in [*op.pieces, *op.history])}
        if keys:
            self._wait_for(lambda job: not job.keys.isdisjoint(keys))

    def _wait_for(self, needed) -> None:
        """Wait for the pending saves ``needed`` names (re-raising a bug in one, never swallowing it)."""
        pending = []
        for job in self._saving:
            if needed(job):
                job.future.result()
            else:
                pending.append(job)
        self._saving = pending

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)


@dataclass
class _SaveJob:
    """One step's stores on the save thread: the blocks they read, their chunks' keys."""
    blocks: set[int]
    keys: set[bytes]
    future: Future


def run_beside_the_model() -> None:
    """Move the calling thread off the model's cores. vLLM's CPU worker binds
    its threads (and so this one, at first) to the cores it computes on, and
    keeps one core per NUMA node back for a KV connector's transfers (vLLM's
    ``discover_numa_topology``): the save thread runs there, within the cores
    the engine may use (its parent's), or anywhere off the model's cores."""
    from vllm.platforms import current_platform
    model = os.sched_getaffinity(0)
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        return
    kept = {c for node in current_platform.discover_numa_topology() for c in node}
    cores = (kept & allowed) - model or allowed - model
    if cores:
        os.sched_setaffinity(0, cores)      # 0: this thread only
        logger.debug("kvreel: save thread on cores %s (the model on %s)", sorted(cores), sorted(model))
