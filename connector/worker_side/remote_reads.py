"""The worker's reads from the remote tier: the fetch controller's start (and
the decode profile) and where fetched chunks are delivered (a
request's blocks, or a whole chunk for a prefetch)."""

from __future__ import annotations

import os
import threading
import time

import torch

from kvreel.codec.formats import ChunkError, ChunkUnavailable
from kvreel.connector.config import KVReelConfig
from kvreel.connector.metadata import LoadPiece
from kvreel.connector.worker_side.block_copy import PagedRegions
from kvreel.connector.worker_side.reports import WorkerReports


def start_fetcher(cfg: KVReelConfig, remote, pages: PagedRegions, kv_cache_config):
    """The fetch controller that reads ``remote`` (this rank's ``RemoteTier``);
    the decode profile of each stored form is measured on a thread meanwhile."""
    from kvreel.connector.worker_side.fetch.decode_profile import DecodeProfile, synthetic_payload
    from kvreel.connector.worker_side.fetch.controller import FetchController
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    forms = remote.forms
    chunk_shape = (len(pages.regions), max(1, cfg.chunk_tokens // spec.block_size), pages.block_bytes)
    device = torch.cuda.get_device_name(pages.device) if pages.is_cuda else f"cpu{os.cpu_count()}"
    profile = DecodeProfile(f"{device}|{'x'.join(map(str, chunk_shape))}|{cfg.remote_quant}")
    fixed = None if cfg.fetch_form == "auto" else cfg.fetch_form
    fetcher = FetchController(remote, profile, streams=cfg.fetch_streams, policy=cfg.fetch_policy,
                              fixed_form=fixed, device=pages.device)
    payload = synthetic_payload(torch.Size(chunk_shape))
    threading.Thread(target=profile.measure, name="kvreel-decode-profile", daemon=True, args=(
        forms.names(), lambda: forms.encode([bytes(32)] * chunk_shape[1], payload), forms.decode)).start()
    return fetcher


class RemoteRestore:
    """Where the fetch controller delivers a request's remote chunks: each
    verified part is scattered into the piece's blocks as it arrives; each
    finished chunk is booked, or failed (its blocks are recomputed). ``worker``:
    the ``KVReelWorker`` that loads them (its pages, checks and reports)."""

    def __init__(self, worker, req_id: str, pieces: list[LoadPiece]):
        self.worker, self.req_id, self.pieces, self.t0 = worker, req_id, pieces, time.perf_counter()

    def part(self, index: int, first_region: int, rows: torch.Tensor) -> None:
        piece = self.pieces[index]
        self.worker.check_fits(rows, piece, first_region, whole=False)
        self.worker.pages.scatter(rows, piece.block_ids, piece.row_slice, first_region=first_region)

    def done(self, result) -> None:
        w, piece = self.worker, self.pieces[result.index]
        try:
            checked(w.reports, result)
            w.check_fits(result.payload, piece)      # every region arrived through part()
            w.restored(piece, result.payload, self.t0)
        except ChunkError as e:
            w.reports.failed(self.req_id, piece, e)


def checked(reports: WorkerReports, result) -> None:
    """Count a fetched chunk; raise its error as a ChunkError."""
    for name, value in (("remote_fetches", 1), ("remote_fetch_bytes", result.wire_bytes),
                        ("remote_transfer_seconds", result.transmit_s), ("decode_seconds", result.decode_s)):
        reports.count(name, value, result.form)
    if result.error is not None:
        raise result.error if isinstance(result.error, ChunkError) else ChunkUnavailable(str(result.error))


class WholeChunk:
    """A fetch sink for one whole chunk (a prefetch into the host tier)."""

    def __init__(self, reports: WorkerReports):
        self.reports, self.result = reports, None

    def part(self, index: int, first_region: int, rows: torch.Tensor) -> None:
        pass

    def done(self, result) -> None:
        self.result = result

    def payload(self) -> torch.Tensor:
        checked(self.reports, self.result)
        return self.result.payload
