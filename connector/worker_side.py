"""Worker side of the connector: moves pages between vLLM's paged cache and the
tiers (``kvreel.connector.tiers``) exactly as the scheduler side planned, and
reports what failed."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvreel.codec.formats import ChunkError, ChunkUnavailable
from kvreel.connector.block_copy import PagedRegions
from kvreel.connector.config import KVReelConfig
from kvreel.connector.metadata import HistoryPiece, KVReelMetadata, KVReelWorkerMeta, LoadOp, LoadPiece
from kvreel.connector.stats import KVReelStats
from kvreel.connector.tiers import ChunkTier, Tier
from kvreel.connector.tiers.disk import DiskTier
from kvreel.connector.tiers.host import HostTier
from kvreel.connector.worker_reports import WorkerReports

logger = logging.getLogger(__name__)


class KVReelWorker:
    def __init__(self, cfg: KVReelConfig, identity: str, rank: int, description: dict | None = None):
        self.cfg = cfg
        self.identity = identity
        self.description = description     # what the identity digest stands for (model, dtypes, layout)
        self.rank = rank
        self.pages: PagedRegions | None = None
        self.every_tier: dict[Tier, ChunkTier] = {Tier.HOST: HostTier()}
        self.tiers: dict[Tier, ChunkTier] = dict(self.every_tier)     # those on (a full disk goes off a while)
        self.fetcher = None
        # async loads mostly wait on the disk or the fetch controller: one thread per parked request
        self._loader = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvreel-load")
        self._async: dict[str, Future] = {}
        # workflow prefetches (disk or remote -> host) on a thread of their own, behind nothing a request waits for
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreel-prefetch")
        self.reports = WorkerReports()
        self.retrieval = None           # the retrieval runtime (KVREEL_RETRIEVAL), imported only when on
        # on a CPU engine a step's saves copy on a thread of their own, beside the model's cores,
        # while the next step runs (until it writes their blocks: before_writes)
        self._saver: ThreadPoolExecutor | None = None
        self._saving: list[_SaveJob] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config,
                           max_batched_tokens: int) -> None:
        self.pages = PagedRegions(kv_caches, kv_cache_config)
        if not self.pages.is_cuda and self.cfg.save_copy == "thread":   # CUDA: on a side stream (block_copy)
            self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreel-save",
                                             initializer=run_beside_the_model)
        if self.cfg.retrieval != "off":
            from kvreel.connector.retrieval.runtime import RetrievalRuntime
            self.retrieval = RetrievalRuntime.get(self.cfg)
            self.retrieval.register_caches(kv_caches, kv_cache_config.kv_cache_groups[0].kv_cache_spec,
                                           max_batched_tokens)
            if len(self.pages.regions) != self.retrieval.num_layers:
                raise RuntimeError("kvreel: KVREEL_RETRIEVAL needs one KV cache tensor per layer "
                                   f"(this engine packs {self.retrieval.num_layers} layers into "
                                   f"{len(self.pages.regions)} regions)")
        if self.cfg.disk_dir:
            self.add_tier(DiskTier(self.cfg.disk_dir, self.identity, self.rank, self.cfg.disk_write_queue,
                                    description=self.description))
        if self.cfg.remote_url:
            self._start_remote(kv_cache_config)

    def _start_remote(self, kv_cache_config) -> None:
        from kvreel.codec.forms import KVView, StoredForms
        from kvreel.connector.tiers.remote import RemoteTier
        from kvreel.scheduler.decode_profile import DecodeProfile, synthetic_payload
        from kvreel.scheduler.fetch_controller import FetchController
        cfg, pages = self.cfg, self.pages
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        kv_view = KVView(pages.block_bytes, spec) if "video" in cfg.remote_forms else None
        # each rank holds its own shard of the KV: one namespace per rank
        ident = self.identity if self.rank == 0 else f"{self.identity}-r{self.rank}"
        forms = StoredForms(ident, kinds=cfg.remote_forms, quant=cfg.remote_quant,
                            resolutions=cfg.remote_resolutions, kv_view=kv_view)
        forms.device = pages.device
        remote = RemoteTier(cfg.remote_url, forms, cfg.remote_timeout_s, cfg.remote_write_queue)
        self.add_tier(remote)
        chunk_shape = (len(pages.regions), max(1, cfg.chunk_tokens // spec.block_size), pages.block_bytes)
        device = torch.cuda.get_device_name(pages.device) if pages.is_cuda else f"cpu{os.cpu_count()}"
        profile = DecodeProfile(f"{device}|{'x'.join(map(str, chunk_shape))}|{cfg.remote_quant}")
        fixed = None if cfg.fetch_form == "auto" else cfg.fetch_form
        self.fetcher = FetchController(remote, profile, streams=cfg.fetch_streams, policy=cfg.fetch_policy,
                                       fixed_form=fixed, device=pages.device)
        payload = synthetic_payload(torch.Size(chunk_shape))
        threading.Thread(target=profile.measure, name="kvreel-decode-profile", daemon=True, args=(
            forms.names(), lambda: forms.encode([bytes(32)] * chunk_shape[1], payload), forms.decode)).start()

    # -- loads ---------------------------------------------------------------
    def bind(self, meta: KVReelMetadata) -> None:
        """The step's plan, before its forward pass: which rows attend to an offloaded history."""
        if self.retrieval is not None and meta.history is not None:
            self.retrieval.begin_step(meta.history.rows, meta.history.dropped)

    def start_load_kv(self, meta: KVReelMetadata) -> None:
        self.before_writes(meta)
        self._saved_before_reads(meta)
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
        sink = _WholeChunk(self.reports)
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
                self._check_fits(data, piece)
                self.pages.scatter(data, piece.block_ids, piece.row_slice)
                self._restored(piece, data, t0)
            except ChunkError as e:
                self.reports.failed(op.req_id, piece, e)
        if remote:
            if self.fetcher is None:
                for piece in remote:
                    self.reports.failed(op.req_id, piece,
                                        ChunkUnavailable("remote tier is not configured on this worker"))
            else:
                self.fetcher.fetch(op.req_id, [p.key for p in remote], _RemoteRestore(self, op.req_id, remote))

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

    def _check_fits(self, data: torch.Tensor, piece: LoadPiece, first_region: int = 0, whole: bool = True) -> None:
        """``data`` (regions from ``first_region`` on; all of them if ``whole``) fits the piece's pages."""
        regions = len(self.pages.regions)
        if data.dim() != 3 or data.shape[2] != self.pages.block_bytes or data.shape[1] < piece.row_slice.stop \
                or (first_region + data.shape[0] != regions if whole else first_region + data.shape[0] > regions):
            raise ChunkError(f"chunk shape {tuple(data.shape)} does not fit this engine's pages")

    def _restored(self, piece: LoadPiece, data: torch.Tensor, t0: float) -> None:
        """Book a chunk whose blocks now hold its KV (and keep it in the host tier if planned)."""
        if piece.promote_to_host:
            self.tiers[Tier.HOST].put(piece.key, [], data)
        self.reports.loaded(piece.tier, piece.rows * self.pages.bytes_per_block, t0)

    # -- saves ---------------------------------------------------------------
    def wait_for_save(self, meta: KVReelMetadata) -> None:
        """Store the step's chunks: at once on CUDA; on a CPU engine on the save
        thread, while vLLM goes on to the next step."""
        assert self.pages is not None
        if self.retrieval is not None and meta.history is not None:
            for op in meta.history.appends:
                self.retrieval.append_history(op.req_id, op.first_block, op.block_ids, op.room_blocks,
                                              op.most_blocks, op.reach_blocks)
        if not meta.stores:
            return
        if self._saver is None:
            self._save(meta.stores)
            return
        blocks = {b for op in meta.stores for ids in op.block_ids for b in ids}
        self._wait_for(lambda job: job.future.done())          # forget those done (raising their bugs)
        self._saving.append(_SaveJob(blocks, {op.key for op in meta.stores},
                                     self._saver.submit(self._save, meta.stores)))

    def _save(self, stores: list) -> None:
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

    def _saved_before_reads(self, meta: KVReelMetadata) -> None:
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

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        for fut in list(self._async.values()):
            fut.result(timeout=60)
        self._loader.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if self.fetcher is not None:
            self.fetcher.close()
        for tier in self.every_tier.values():
            tier.close()


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


class _RemoteRestore:
    """Where the fetch controller delivers a request's remote chunks: each
    verified part is scattered into the piece's blocks as it arrives; each
    finished chunk is booked, or failed (its blocks are recomputed)."""

    def __init__(self, worker: KVReelWorker, req_id: str, pieces: list[LoadPiece]):
        self.worker, self.req_id, self.pieces, self.t0 = worker, req_id, pieces, time.perf_counter()

    def part(self, index: int, first_region: int, rows: torch.Tensor) -> None:
        piece = self.pieces[index]
        self.worker._check_fits(rows, piece, first_region, whole=False)
        self.worker.pages.scatter(rows, piece.block_ids, piece.row_slice, first_region=first_region)

    def done(self, result) -> None:
        w, piece = self.worker, self.pieces[result.index]
        try:
            _checked(w.reports, result)
            w._check_fits(result.payload, piece)      # every region arrived through part()
            w._restored(piece, result.payload, self.t0)
        except ChunkError as e:
            w.reports.failed(self.req_id, piece, e)


def _checked(reports: WorkerReports, result) -> None:
    """Count a fetched chunk; raise its error as a ChunkError."""
    for name, value in (("remote_fetches", 1), ("remote_fetch_bytes", result.wire_bytes),
                        ("remote_transfer_seconds", result.transmit_s), ("decode_seconds", result.decode_s)):
        reports.count(name, value, result.form)
    if result.error is not None:
        raise result.error if isinstance(result.error, ChunkError) else ChunkUnavailable(str(result.error))


class _WholeChunk:
    """A fetch sink for one whole chunk (a prefetch into the host tier)."""

    def __init__(self, reports: WorkerReports):
        self.reports, self.result = reports, None

    def part(self, index: int, first_region: int, rows: torch.Tensor) -> None:
        pass

    def done(self, result) -> None:
        self.result = result

    def payload(self) -> torch.Tensor:
        _checked(self.reports, self.result)
        return self.result.payload
