"""Worker side of the connector: moves pages between vLLM's paged cache, the
host tier (a dict of chunk tensors) and the disk tier, exactly as the
scheduler side planned, and reports what failed."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvreel.connector.block_copy import PagedRegions
from kvreel.connector.config import KVReelConfig
from kvreel.connector.disk_tier import ChunkFileError, ChunkUnavailable, DiskTier
from kvreel.connector.metadata import HOST, REMOTE, KVReelMetadata, KVReelWorkerMeta, LoadOp, LoadPiece
from kvreel.connector.retrieval.retriever import take_retrieval_stats
from kvreel.connector.stats import KVReelStats

logger = logging.getLogger("kvreel.worker")


class KVReelWorker:
    def __init__(self, cfg: KVReelConfig, identity: str, rank: int):
        self.cfg = cfg
        self.identity = identity
        self.rank = rank
        self.pages: PagedRegions | None = None
        self.host: dict[bytes, torch.Tensor] = {}
        self.disk: DiskTier | None = None
        self.remote = None
        self.fetcher = None
        self._disk_disabled: str | None = None
        # async loads mostly wait on the disk or the fetch controller: one thread per parked request
        self._loader = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvreel-load")
        self._async: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._bad_keys: set[bytes] = set()
        self._reported_bad: set[bytes] = set()
        self.stats = KVReelStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config) -> None:
        self.pages = PagedRegions(kv_caches, kv_cache_config)
        if self.cfg.disk_dir:
            self.disk = DiskTier(self.cfg.disk_dir, self.identity, self.rank, self.cfg.disk_write_queue,
                                 on_error=self._on_disk_error)
        if self.cfg.remote_url:
            self._start_remote(kv_cache_config)

    def _start_remote(self, kv_cache_config) -> None:
        from kvreel.connector.block_copy import KVView
        from kvreel.connector.remote_tier import RemoteTier
        from kvreel.scheduler.decode_profile import DecodeProfile, synthetic_payload
        from kvreel.scheduler.fetch_controller import FetchController
        cfg, pages = self.cfg, self.pages
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        kv_view = KVView(pages.block_bytes, spec) if "video" in cfg.remote_forms else None
        # each rank holds its own shard of the KV: one namespace per rank
        ident = self.identity if self.rank == 0 else f"{self.identity}-r{self.rank}"
        self.remote = RemoteTier(cfg.remote_url, ident, cfg.remote_timeout_s, cfg.remote_write_queue,
                                 forms=cfg.remote_forms, quant=cfg.remote_quant,
                                 resolutions=cfg.remote_resolutions, kv_view=kv_view)
        self.remote.decode_device = pages.device
        chunk_shape = (len(pages.regions), max(1, cfg.chunk_tokens // spec.block_size), pages.block_bytes)
        device = torch.cuda.get_device_name(pages.device) if pages.is_cuda else f"cpu{os.cpu_count()}"
        profile = DecodeProfile(f"{device}|{'x'.join(map(str, chunk_shape))}|{cfg.remote_quant}")
        fixed = None if cfg.fetch_form == "auto" else cfg.fetch_form
        self.fetcher = FetchController(self.remote, profile, streams=cfg.fetch_streams,
                                       policy=cfg.fetch_policy, fixed_form=fixed, device=pages.device)
        payload = synthetic_payload(torch.Size(chunk_shape))
        names = [f for f in ("raw", "zstd") if f in cfg.remote_forms] + \
            [f"video@{r}" for r in cfg.remote_resolutions if "video" in cfg.remote_forms]
        threading.Thread(target=profile.measure, name="kvreel-decode-profile", daemon=True, args=(
            names, lambda: self.remote.encode_forms([bytes(32)] * chunk_shape[1], payload),
            self.remote.decode_form)).start()

    def _on_disk_error(self, msg: str) -> None:
        self._disk_disabled = msg

    # -- loads ---------------------------------------------------------------
    def start_load_kv(self, meta: KVReelMetadata) -> None:
        for key in meta.evict_host:
            self.host.pop(key, None)
        if self.disk is not None:
            for key in meta.evict_disk:
                self.disk.submit_delete(key)
        for op in meta.loads:
            if op.is_async:
                self._async[op.req_id] = self._loader.submit(self._load, op)
            else:
                self._load(op)

    def _load(self, op: LoadOp) -> None:
        assert self.pages is not None
        remote = [p for p in op.pieces if p.tier == REMOTE]
        for piece in op.pieces:
            if piece.tier == REMOTE:
                continue
            t0 = time.perf_counter()
            try:
                if piece.tier == HOST:
                    data = self.host.get(piece.key)
                    if data is None:
                        raise ChunkUnavailable("chunk is no longer in the host tier")
                else:
                    if self.disk is None:
                        raise ChunkUnavailable("disk tier is disabled")
                    data = self.disk.read(piece.key)
                self._restore(piece, data, t0)
            except ChunkFileError as e:
                self._failed(piece, e)
        if remote:
            self._load_remote(op.req_id, remote)

    def _load_remote(self, req_id: str, pieces: list[LoadPiece]) -> None:
        """Stream the remote pieces through the fetch controller, restoring each as it arrives."""
        if self.remote is None:
            for piece in pieces:
                self._failed(piece, ChunkUnavailable("remote tier is not configured on this worker"))
            return
        t0 = time.perf_counter()

        def on_part(index: int, first: int, rows: torch.Tensor) -> None:
            piece = pieces[index]
            self._check_fits(rows, piece, first, whole=False)
            self.pages.scatter(rows, piece.block_ids, self._rows(piece), first_region=first)

        def on_chunk(r):
            piece = pieces[r.index]
            with self._lock:
                self.stats.add("remote_fetches", 1, r.form)
                self.stats.add("remote_fetch_bytes", r.wire_bytes, r.form)
                self.stats.add("remote_transfer_seconds", r.transmit_s, r.form)
                self.stats.add("decode_seconds", r.decode_s, r.form)
            try:
                if r.error is not None:
                    raise r.error if isinstance(r.error, ChunkFileError) else ChunkUnavailable(str(r.error))
                self._check_fits(r.payload, piece)      # every region arrived through on_part
                self._restored(piece, r.payload, t0)
            except ChunkFileError as e:
                self._failed(piece, e)
        self.fetcher.fetch(req_id, [p.key for p in pieces], on_chunk, on_part)

    @staticmethod
    def _rows(piece: LoadPiece) -> slice:
        return slice(piece.first, piece.first + len(piece.block_ids))

    def _check_fits(self, data: torch.Tensor, piece: LoadPiece, first_region: int = 0, whole: bool = True) -> None:
        """``data`` (regions from ``first_region`` on; all of them if ``whole``) fits the piece's pages."""
        regions = len(self.pages.regions)
        if data.dim() != 3 or data.shape[2] != self.pages.block_bytes or data.shape[1] < self._rows(piece).stop \
                or (first_region + data.shape[0] != regions if whole else first_region + data.shape[0] > regions):
            raise ChunkFileError(f"chunk shape {tuple(data.shape)} does not fit this engine's pages")

    def _restore(self, piece: LoadPiece, data: torch.Tensor, t0: float) -> None:
        self._check_fits(data, piece)
        self.pages.scatter(data, piece.block_ids, self._rows(piece))
        self._restored(piece, data, t0)

    def _restored(self, piece: LoadPiece, data: torch.Tensor, t0: float) -> None:
        """Book a chunk whose blocks now hold its KV (and keep it in the host tier if planned)."""
        if piece.promote_to_host:
            self.host[piece.key] = data.cpu()
        with self._lock:
            self.stats.add("loaded_bytes", len(piece.block_ids) * self.pages.bytes_per_block, piece.tier)
            self.stats.add("load_seconds", time.perf_counter() - t0, piece.tier)
            self.stats.add("load_count", 1, piece.tier)

    def _failed(self, piece: LoadPiece, e: ChunkFileError) -> None:
        with self._lock:
            self._load_errors.update(piece.block_ids)
            self._bad_keys.add(piece.key)
            if not isinstance(e, ChunkUnavailable):
                self.stats.add("corrupt_chunks", label=piece.tier)
            self.stats.add("load_errors", len(piece.block_ids))
            first_report = piece.key not in self._reported_bad
            self._reported_bad.add(piece.key)
        if first_report:
            what = "could not load" if isinstance(e, ChunkUnavailable) else "rejected"
            logger.warning("kvreel: %s %s chunk %s (%s); its %d blocks will be recomputed",
                           what, piece.tier, piece.key.hex()[:16], e, len(piece.block_ids))

    # -- saves ---------------------------------------------------------------
    def wait_for_save(self, meta: KVReelMetadata) -> None:
        assert self.pages is not None
        for op in meta.stores:
            if not (op.to_host or op.to_disk or op.to_remote):
                continue
            t0 = time.perf_counter()
            data = self.pages.gather(op.block_ids)
            if op.to_host:
                self.host[op.key] = data
            if op.to_disk and self.disk is not None:
                self.disk.submit_write(op.key, op.block_hashes, data)
            if op.to_remote and self.remote is not None:
                self.remote.submit_upload(op.key, op.block_hashes, data)
            with self._lock:
                self.stats.add("save_seconds", time.perf_counter() - t0)
                self.stats.add("save_count")

    # -- reporting -------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {rid for rid, fut in self._async.items() if fut.done()}
        for rid in done:
            self._async.pop(rid).result()  # re-raise bugs, never swallow them
        return None, done or None

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KVReelWorkerMeta | None:
        with self._lock:
            bad, self._bad_keys = self._bad_keys, set()
        failed: set[bytes] = set()
        if self.disk is not None:
            failed = set(self.disk.failed_keys)
            self.disk.failed_keys.clear()
        meta = KVReelWorkerMeta(bad, failed, self._disk_disabled)
        if self._disk_disabled:
            self.disk = None
            self._disk_disabled = None
        return None if meta.is_empty() else meta

    def take_stats(self) -> KVReelStats | None:
        with self._lock:
            if self.remote is not None:
                failures = self.remote.take_upload_failures()
                if failures:
                    self.stats.add("remote_upload_failures", failures)
                for form, seconds in self.remote.take_encode_seconds().items():
                    self.stats.add("encode_seconds", seconds, form)
            retrieval = take_retrieval_stats()
            if retrieval is not None:
                self.stats.aggregate(retrieval)
            return self.stats.take()

    def shutdown(self) -> None:
        for fut in list(self._async.values()):
            fut.result(timeout=60)
        self._loader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.flush()
            self.disk.close()
        if self.fetcher is not None:
            self.fetcher.close()
        if self.remote is not None:
            self.remote.close()
