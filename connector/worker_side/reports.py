"""What the worker side reports: blocks and requests whose loads failed (vLLM
recomputes them), chunks found damaged (the scheduler side forgets them),
prefetches that landed or failed, and the counters. Loads run on vLLM's
thread, the loader pool, the fetch controller and the prefetcher: everything
here is kept under one lock."""

from __future__ import annotations

import logging
import threading
import time

from kvreel.codec.formats import ChunkError, ChunkUnavailable
from kvreel.connector.metadata import HistoryPiece, KVReelWorkerMeta, LoadPiece
from kvreel.connector.stats import KVReelStats, collect_registered_stats
from kvreel.connector.tiers import ChunkTier, Tier

logger = logging.getLogger(__name__)


class WorkerReports:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = KVReelStats()
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()
        self._bad_keys: set[bytes] = set()
        self._reported_bad: set[bytes] = set()
        self._prefetched: dict[bytes, int] = {}
        self._prefetch_failed: set[bytes] = set()
        self._history_bytes: int | None = None      # to tell the scheduler
        self._history_told = 0

    def count(self, name: str, value: float = 1, label: str | None = None) -> None:
        with self.lock:
            self.stats.add(name, value, label)

    def loaded(self, tier: Tier, nbytes: int, t0: float) -> None:
        with self.lock:
            self.stats.add("loaded_bytes", nbytes, tier)
            self.stats.add("load_seconds", time.perf_counter() - t0, tier)
            self.stats.add("load_count", 1, tier)

    def failed(self, req_id: str, piece: LoadPiece, e: ChunkError) -> None:
        """A piece that could not be restored: its blocks are recomputed."""
        with self.lock:
            if len(piece.block_ids) == 1:
                self._load_errors.update(piece.block_ids[0])
            else:       # block ids are unique only within a KV cache group: vLLM recomputes the request
                self._failed_requests.add(req_id)
            self._bad_keys.add(piece.key)
            if not isinstance(e, ChunkUnavailable):
                self.stats.add("corrupt_chunks", label=piece.tier)
            self.stats.add("load_errors", piece.rows)
            first_report = piece.key not in self._reported_bad
            self._reported_bad.add(piece.key)
        if first_report:
            what = "could not load" if isinstance(e, ChunkUnavailable) else "rejected"
            logger.warning("kvreel: %s %s chunk %s (%s); its %d blocks will be recomputed",
                           what, piece.tier.value, piece.key.hex()[:16], e, piece.rows)

    def history_failed(self, req_id: str, piece: HistoryPiece, e: ChunkError) -> None:
        """History that cannot be brought back is never attended to: the request
        is reported as a failed load, and vLLM recomputes it from its start
        (without the damaged chunk, which the scheduler forgets)."""
        with self.lock:
            self._failed_requests.add(req_id)
            self._bad_keys.add(piece.key)
            if not isinstance(e, ChunkUnavailable):
                self.stats.add("corrupt_chunks", label=piece.tier)
            self.stats.add("load_errors", piece.n)
        logger.warning("kvreel: could not load the history of request %s (%s chunk %s: %s); "
                       "it is recomputed from its start", req_id, piece.tier.value, piece.key.hex()[:16], e)

    def prefetched(self, key: bytes) -> None:
        with self.lock:
            self._prefetched[key] = 1

    def prefetch_failed(self, key: bytes, tier: Tier, e: Exception | None) -> None:
        with self.lock:
            self._prefetch_failed.add(key)
            if isinstance(e, ChunkError) and not isinstance(e, ChunkUnavailable):
                self._bad_keys.add(key)
                self.stats.add("corrupt_chunks", label=tier)

    def take_failed_requests(self, done: set[str]) -> set[str]:
        """Of the requests whose loads are done, those that failed."""
        with self.lock:
            failed = self._failed_requests & done
            self._failed_requests -= failed
        return failed

    def histories_take(self, nbytes: int) -> None:
        """What the long requests' histories take now: told once where it changed."""
        with self.lock:
            if nbytes != self._history_told:
                self._history_bytes = self._history_told = nbytes

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_meta(self, tiers: dict[Tier, ChunkTier]) -> KVReelWorkerMeta | None:
        """What the scheduler must hear since the last call, with every tier's
        failed writes and changes (``tiers``: each tier, on or off)."""
        meta = KVReelWorkerMeta()
        for kind, tier in tiers.items():
            failed = tier.take_failed_writes()
            if failed:
                meta.failed_writes[kind] = failed
            changes = tier.take_changes()
            if changes.went_off:
                meta.tiers_off[kind] = changes.went_off
            if changes.came_back:
                meta.tiers_back.add(kind)
        with self.lock:
            meta.bad_keys, self._bad_keys = self._bad_keys, set()
            meta.prefetched, self._prefetched = self._prefetched, {}
            meta.prefetch_failed, self._prefetch_failed = self._prefetch_failed, set()
            meta.history_bytes, self._history_bytes = self._history_bytes, None
        return None if meta.is_empty() else meta

    def take_stats(self, tiers: dict[Tier, ChunkTier]) -> KVReelStats | None:
        """The counters since the last call, with the tiers' encode times and other features' own."""
        with self.lock:
            for tier in tiers.values():
                for form, seconds in tier.take_encode_seconds().items():
                    self.stats.add("encode_seconds", seconds, form)
            for extra in collect_registered_stats():
                self.stats.aggregate(extra)
            return self.stats.take()
