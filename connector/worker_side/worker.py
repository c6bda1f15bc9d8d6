"""Worker side of the connector: moves pages between vLLM's paged cache and the
tiers (``kvreel.connector.tiers``) exactly as the scheduler side planned, and
reports what failed."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvreel.codec.formats import ChunkError, ChunkUnavailable
from kvreel.connector.config import KVReelConfig
from kvreel.connector.metadata import HistoryPiece, KVReelMetadata, KVReelWorkerMeta, LoadOp, LoadPiece
from kvreel.connector.stats import KVReelStats
from kvreel.connector.tiers import ChunkTier, Tier
from kvreel.connector.tiers.specs import tier_specs
from kvreel.connector.worker_side.block_copy import PagedRegions
from kvreel.connector.worker_side.remote_reads import RemoteRestore, WholeChunk, start_fetcher
from kvreel.connector.worker_side.reports import WorkerReports
from kvreel.connector.worker_side.saves import PageSaver

logger = logging.getLogger(__name__)


class KVReelWorker:
    def __init__(self, cfg: KVReelConfig, identity: str, rank: int, description: dict | None = None):
        self.cfg = cfg
        self.identity = identity
        self.description = description     # what the identity digest stands for (model, dtypes, layout)
        self.rank = rank
        self.pages: PagedRegions | None = None
        self.specs = tier_specs(cfg, identity)
        self.every_tier: dict[Tier, ChunkTier] = {}         # each tier's worker half, built with the pages
        self.tiers: dict[Tier, ChunkTier] = {}              # those on (a full disk goes off a while)
        self.fetcher = None
        # async loads mostly wait on the disk or the fetch controller: one thread per parked request
        self._loader = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvreel-load")
        self._async: dict[str, Future] = {}
        # workflow prefetches (disk or remote -> host) on a thread of their own, behind nothing a request waits for
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreel-prefetch")
        self.reports = WorkerReports()
        self.retrieval = None           # the retrieval runtime (KVREEL_RETRIEVAL), imported only when on
        self.saver: PageSaver | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config,
                           max_batched_tokens: int) -> None:
        self.pages = PagedRegions(kv_caches, kv_cache_config)
        self.saver = PageSaver(self.pages, self.tiers, self.reports,
                               on_thread=not self.pages.is_cuda and self.cfg.save_copy == "thread")
        if self.cfg.retrieval != "off":
            from kvreel.connector.retrieval.runtime import RetrievalRuntime
            self.retrieval = RetrievalRuntime.built()
            if self.retrieval is None:
                logger.error("kvreel: KVREEL_RETRIEVAL=%s, but this engine's attention layers are vLLM's own "
                             "(kvreel's retrieval backend runs on vLLM's CPU platform): attention stays full",
                             self.cfg.retrieval)
        if self.retrieval is not None:
            self.retrieval.register_caches(kv_caches, kv_cache_config.kv_cache_groups[0].kv_cache_spec,
                                           max_batched_tokens)
            if len(self.pages.regions) != self.retrieval.num_layers:
                raise RuntimeError("kvreel: KVREEL_RETRIEVAL needs one KV cache tensor per layer "
                                   f"(this engine packs {self.retrieval.num_layers} layers into "
                                   f"{len(self.pages.regions)} regions)")
        for spec in self.specs.values():
            self.add_tier(spec.worker_half(self.rank, self.pages, kv_cache_config, self.description))
        if Tier.REMOTE in self.tiers:
            self.fetcher = start_fetcher(self.cfg, self.tiers[Tier.REMOTE], self.pages, kv_cache_config)

    # -- loads ---------------------------------------------------------------
    def bind(self, meta: KVReelMetadata) -> None:
        """The step's plan, before its forward pass: which rows attend to an offloaded history."""
        if self.retrieval is not None and meta.history is not None:
            self.retrieval.begin_step(meta.history.rows, meta.history.dropped)

    def start_load_kv(self, meta: KVReelMetadata) -> None:
        self.saver.before_writes(meta)
        self.saver.before_reads(meta)
        for tier, keys in meta.evictions.items():
            if tier in self.tiers:
                for key in keys:
                    self.tiers[tier].delete(key)
        for op in meta.loads:
            if op.is_async:
                self._async[op.req_id] = self._loader.submit(self._load, op)
            else:
                self._load(op)
        for key, tier in meta.prefetches:
            self._prefetcher.submit(self._prefetch, key, tier)

    def _prefetch(self, key: bytes, tier: Tier) -> None:
        """Read a chunk from disk or the remote store into the host tier (a
        workflow prefetch; verified like any load)."""
        try:
            source = self.tiers.get(tier)
            if source is None:
                raise ChunkUnavailable(f"the {tier.value} tier is disabled")
            data = self._fetch_whole(key) if tier == Tier.REMOTE else source.get(key)
        except ChunkError as e:
            self.reports.prefetch_failed(key, tier, e)
            logger.warning("kvreel: prefetch of %s chunk %s failed (%s)", tier.value, key.hex()[:16], e)
            return
        except Exception:                # a bug here must not leave the scheduler's reservation behind
            logger.exception("kvreel: prefetch of %s chunk %s failed", tier.value, key.hex()[:16])
            self.reports.prefetch_failed(key, tier, None)
            return
        self.tiers[Tier.HOST].put(key, [], data)
        self.reports.prefetched(key)

    def _fetch_whole(self, key: bytes) -> torch.Tensor:
        """A remote chunk's verified payload, through the fetch controller like
        every remote read (its form choice, streams and fairness)."""
        sink = WholeChunk(self.reports)
        self.fetcher.fetch(f"prefetch-{key.hex()[:16]}", [key], sink)
        return sink.payload()

    def _load(self, op: LoadOp) -> None:
        assert self.pages is not None
        for piece in op.history:
            try:
                self._load_history(op.req_id, piece)
            except ChunkError as e:
                self.reports.history_failed(op.req_id, piece, e)
                if self.retrieval is not None:
                    self.retrieval.drop(op.req_id)
                return              # vLLM recomputes the request from scratch
        remote = [p for p in op.pieces if p.tier == Tier.REMOTE]
        for piece in op.pieces:
            if piece.tier == Tier.REMOTE:
                continue
            t0 = time.perf_counter()
            try:
                tier = self.tiers.get(piece.tier)
                if tier is None:
                    raise ChunkUnavailable(f"the {piece.tier.value} tier is disabled")
                data = tier.get(piece.key)
                self.check_fits(data, piece)
                self.pages.scatter(data, piece.block_ids, piece.row_slice)
                self.restored(piece, data, t0)
            except ChunkError as e:
                self.reports.failed(op.req_id, piece, e)
        if remote:
            if self.fetcher is None:
                for piece in remote:
                    self.reports.failed(op.req_id, piece,
                                        ChunkUnavailable("remote tier is not configured on this worker"))
            else:
                self.fetcher.fetch(op.req_id, [p.key for p in remote], RemoteRestore(self, op.req_id, remote))

    def _load_history(self, req_id: str, piece: HistoryPiece) -> None:
        """Blocks of an admitted long prefix, from a local tier into the request's history."""
        t0 = time.perf_counter()
        tier = self.tiers.get(piece.tier)
        if tier is None or self.retrieval is None:
            raise ChunkUnavailable(f"the {piece.tier.value} tier is disabled")
        data = tier.get(piece.key)
        if data.dim() != 3 or data.shape[0] != len(self.pages.regions) or data.shape[1] < piece.first + piece.n \
                or data.shape[2] != self.pages.block_bytes:
            raise ChunkError(f"chunk shape {tuple(data.shape)} does not fit this engine's pages")
        rows = data[:, piece.first:piece.first + piece.n]
        self.retrieval.add_history(req_id, piece.first_block, [self.retrieval.as_pages(r) for r in rows])
        self.reports.loaded(piece.tier, piece.n * self.pages.bytes_per_block, t0)

    def check_fits(self, data: torch.Tensor, piece: LoadPiece, first_region: int = 0, whole: bool = True) -> None:
        """``data`` (regions from ``first_region`` on; all of them if ``whole``) fits the piece's pages."""
        regions = len(self.pages.regions)
        if data.dim() != 3 or data.shape[2] != self.pages.block_bytes or data.shape[1] < piece.row_slice.stop \
                or (first_region + data.shape[0] != regions if whole else first_region + data.shape[0] > regions):
            raise ChunkError(f"chunk shape {tuple(data.shape)} does not fit this engine's pages")

    def restored(self, piece: LoadPiece, data: torch.Tensor, t0: float) -> None:
        """Book a chunk whose blocks now hold its KV (and keep it in the host tier if planned)."""
        if piece.promote_to_host:
            self.tiers[Tier.HOST].put(piece.key, [], data)
        self.reports.loaded(piece.tier, piece.rows * self.pages.bytes_per_block, t0)

    # -- reporting -------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) request ids."""
        done = {rid for rid, fut in self._async.items() if fut.done()}
        for rid in done:
            self._async.pop(rid).result()  # re-raise bugs, never swallow them
        return set(), done, self.reports.take_failed_requests(done)

    def take_load_errors(self) -> set[int]:
        return self.reports.take_load_errors()

    def add_tier(self, tier: ChunkTier) -> None:
        """Drive ``tier`` (one per kind) as the config asks; tests put a fake one in."""
        self.every_tier[tier.kind] = self.tiers[tier.kind] = tier

    def take_worker_meta(self) -> KVReelWorkerMeta | None:
        if self.retrieval is not None:
            self.reports.histories_take(self.retrieval.reserved_bytes())
        meta = self.reports.take_meta(self.every_tier)
        for kind in meta.tiers_off if meta else ():
            self.tiers.pop(kind, None)
        for kind in meta.tiers_back if meta else ():
            self.tiers[kind] = self.every_tier[kind]
        return meta

    def take_stats(self) -> KVReelStats | None:
        return self.reports.take_stats(self.every_tier)

    def wait_for_save(self, meta: KVReelMetadata) -> None:
        """Grow the step's long-session histories and store its chunks (``PageSaver``)."""
        assert self.pages is not None
        if self.retrieval is not None and meta.history is not None:
            for op in meta.history.appends:
                self.retrieval.append_history(op.req_id, op.first_block, op.block_ids, op.room_blocks,
                                              op.most_blocks, op.reach_blocks)
        self.saver.save(meta.stores)

    def before_writes(self, meta: KVReelMetadata) -> None:
        self.saver.before_writes(meta)

    def shutdown(self) -> None:
        if self.saver is not None:
            self.saver.shutdown()
        for fut in list(self._async.values()):
            fut.result(timeout=60)
        self._loader.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if self.fetcher is not None:
            self.fetcher.close()
        for tier in self.every_tier.values():
            tier.close()
