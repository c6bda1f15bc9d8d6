"""The fetch controller: streams remote chunks for parked requests (KVFetcher §3.3).

Requests whose prefix lives remotely wait in vLLM's WAITING_FOR_REMOTE_KVS
state while this controller moves their chunks; other requests keep running.
``streams`` worker threads each take one chunk at a time: from the request with
the fewest chunks in flight, served longest ago (``fair``: concurrent fetches
share the link equally, a lone fetch gets every stream) or from the oldest
request (``fcfs``). For every chunk the form is chosen just before
it is fetched (``choose``: bandwidth measured on the previous transfers, decode
time from the machine's profile scaled by the decoders' current load, a penalty
for switching resolution). The stream then hands the bytes to the decoder pool
(``kvreel.codec.forms`` decodes and verifies them) and moves on to the next
transfer (transfer and decoding overlap, at most two chunks per decoder ahead).
While a chunk decodes, each verified part (a layer triplet of the video form,
the whole chunk of the byte forms) goes to the request's sink (``part``), which
restores it into the request's blocks; ``done`` then reports the chunk done or
failed. Data flows one way: tier bytes -> decode -> sink.
A damaged or missing form is dropped and the chunk is fetched raw instead; if
the raw form fails too the chunk is reported failed (vLLM recomputes it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvreel.codec.formats import RAW
from kvreel.connector.worker_side.fetch.adaptive import BandwidthEstimator, Candidate, choose
from kvreel.connector.worker_side.fetch.decode_profile import DecodeProfile
from kvreel.connector.worker_side.fetch.decoder_pool import DecoderPool

logger = logging.getLogger(__name__)
SWITCH_PENALTY_S = 0.002     # a new decoder configuration when the resolution changes


@dataclass
class ChunkResult:
    index: int
    payload: object | None         # torch.Tensor [regions, blocks, block_bytes]
    error: Exception | None
    form: str
    wire_bytes: int = 0
    transmit_s: float = 0.0
    decode_s: float = 0.0


class ChunkSink(Protocol):
    """Where a request's fetched chunks go."""

    def part(self, index: int, first_region: int, rows: torch.Tensor) -> None:
        """Verified payload rows of chunk ``index``, from region ``first_region`` on."""

    def done(self, result: ChunkResult) -> None:
        """Chunk ``result.index`` is complete (every part delivered) or failed."""


@dataclass
class _Request:
    req_id: str
    jobs: collections.deque
    sink: ChunkSink
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    previous_form: str | None = None
    in_flight: int = 0
    last_served: int = -1


class FetchController:
    def __init__(self, tier, profile: DecodeProfile, *, streams: int = 4, decoders: int | None = None,
                 policy: str = "fair", fixed_form: str | None = None, initial_Bps: float = 1.25e9,
                 device: str | torch.device = "cpu"):
        if policy not in ("fair", "fcfs"):
            raise ValueError(f"policy must be fair or fcfs, got {policy!r}")
        self.tier, self.forms, self.profile = tier, tier.forms, profile
        self.policy, self.fixed_form = policy, fixed_form
        self.streams = streams
        self.bandwidth = BandwidthEstimator(initial_Bps)
        self.decoders = DecoderPool(decoders or streams, device=device)
        # transfers run ahead of decoding by at most this many chunks (bounded memory)
        self._ahead = threading.BoundedSemaphore(2 * self.decoders.workers)
        self._requests: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self._cond = threading.Condition()
        self._served = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._worker, name=f"kvreel-fetch-{i}", daemon=True)
                         for i in range(streams)]
        for t in self._threads:
            t.start()

    def fetch(self, req_id: str, keys: list[bytes], sink: ChunkSink, timeout_s: float | None = None) -> bool:
        """Fetch ``keys`` for one request into ``sink``; returns when all are done
        (True) or ``timeout_s`` passed (False)."""
        if not keys:
            return True
        manifests = self.tier.manifests(keys)
        req = _Request(req_id, collections.deque(zip(range(len(keys)), keys, manifests)), sink, len(keys))
        with self._cond:
            self._requests[req_id] = req
            self._cond.notify_all()
        return req.done.wait(timeout_s)

    def _next_job(self):
        """fair: the request with the fewest chunks in flight, then the one served
        longest ago (one request alone gets every stream); fcfs: the oldest."""
        with self._cond:
            while not self._closed:
                ready = [r for r in self._requests.values() if r.jobs]
                if ready:
                    req = ready[0] if self.policy == "fcfs" else \
                        min(ready, key=lambda r: (r.in_flight, r.last_served))
                    req.in_flight += 1
                    req.last_served = self._served
                    self._served += 1
                    return req, req.jobs.popleft()
                self._cond.wait()
        return None

    def _worker(self) -> None:
        """A transfer stream: fetch a chunk's bytes, hand them to the decoder pool, go on."""
        while True:
            item = self._next_job()
            if item is None:
                return
            req, (index, key, forms) = item
            form = self.choose_form(forms, req.previous_form)
            req.previous_form = form
            self._ahead.acquire()                   # released once the chunk is fully handled
            try:
                fetched = self._transfer(index, key, form)
            finally:
                with self._cond:
                    req.in_flight -= 1
            if isinstance(fetched, ChunkResult):    # the transfer itself failed
                self._finish(req, key, fetched)
            else:
                self.decoders.run(self._decode, req, index, key, form, *fetched).add_done_callback(
                    lambda fut, req=req, key=key: self._finish(req, key, fut.result()))

    def _transfer(self, index: int, key: bytes, form: str):
        """(bytes, seconds) of one stored form, or a failed ChunkResult."""
        t0 = time.perf_counter()
        try:
            data = self.tier.get_form(key, form)
        except Exception as e:  # noqa: BLE001 — any store failure is this chunk's failure
            return ChunkResult(index, None, e, form)
        dt = time.perf_counter() - t0
        self.bandwidth.observe(len(data), dt)
        return data, dt

    def _decode(self, req: _Request, index: int, key: bytes, form: str, data: bytes,
                transmit_s: float) -> ChunkResult:
        t0 = time.perf_counter()
        try:
            payload = self.forms.decode(form, data, key=key,
                                        on_regions=lambda first, rows: req.sink.part(index, first, rows))
        except Exception as e:  # noqa: BLE001 — damaged: drop it so it is not offered again
            self.tier.drop_form(key, form)
            return ChunkResult(index, None, e, form, len(data), transmit_s)
        dt = time.perf_counter() - t0
        self.profile.observe(form, dt)
        return ChunkResult(index, payload, None, form, len(data), transmit_s, dt)

    def _finish(self, req: _Request, key: bytes, result: ChunkResult) -> None:
        """A failed non-raw form is retried raw (inline); then the chunk goes to the sink."""
        try:
            if result.error is not None and result.form != RAW:
                logger.warning("kvreel: %s form of remote chunk %s failed (%s); fetching it raw",
                               result.form, key.hex()[:16], result.error)
                fetched = self._transfer(result.index, key, RAW)
                result = fetched if isinstance(fetched, ChunkResult) else \
                    self._decode(req, result.index, key, RAW, *fetched)
            req.sink.done(result)
        finally:
            self._ahead.release()
            with self._cond:
                req.remaining -= 1
                if req.remaining == 0:
                    self._requests.pop(req.req_id, None)
                    req.done.set()

    def candidates(self, forms: dict[str, int]) -> list[Candidate]:
        """Stored forms with a known size and decode time (raw is always one)."""
        out = []
        for form, nbytes in forms.items():
            decode_s = self.profile.get(form)
            if form == RAW:
                out.append(Candidate(form, nbytes or 1, decode_s or 0.0))
            elif nbytes > 0 and decode_s is not None:
                out.append(Candidate(form, nbytes, decode_s))
        return out

    def choose_form(self, forms: dict[str, int], previous: str | None) -> str:
        if self.fixed_form is not None:
            return self.fixed_form if self.fixed_form in forms else RAW
        best, _ = choose(self.candidates(forms), self.bandwidth.Bps, decoder_load=self.decoders.load,
                         previous=previous, switch_penalty_s=SWITCH_PENALTY_S)
        return best.name

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        self.decoders.close()
        self.profile.save()
