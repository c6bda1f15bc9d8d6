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
and moves on to the next transfer (transfer and decoding overlap, at most two
chunks per decoder ahead). While a chunk decodes, each verified part (a layer
triplet of the video form, the whole chunk of the byte forms) goes to
``on_part``, which restores it into the request's blocks; ``on_chunk`` then
reports the chunk done or failed.
A damaged or missing form is dropped and the chunk is fetched raw instead; if
the raw form fails too the chunk is reported failed (vLLM recomputes it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvreel.scheduler.adaptive import BandwidthEstimator, Candidate, choose
from kvreel.scheduler.decode_profile import DecodeProfile
from kvreel.scheduler.decoder_pool import DecoderPool

logger = logging.getLogger("kvreel.fetch")
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


@dataclass
class _Request:
    req_id: str
    jobs: collections.deque
    on_chunk: Callable[[ChunkResult], None]
    on_part: Callable[[int, int, torch.Tensor], None] | None
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
        self.tier, self.profile, self.policy, self.fixed_form = tier, profile, policy, fixed_form
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

    def fetch(self, req_id: str, keys: list[bytes], on_chunk: Callable[[ChunkResult], None],
              on_part: Callable[[int, int, torch.Tensor], None] | None = None,
              timeout_s: float | None = None) -> bool:
        """Fetch ``keys`` for one request: ``on_part(chunk index, first region, rows)``
        per verified part as it is decoded, ``on_chunk`` once per chunk; returns
        when all are done (True) or ``timeout_s`` passed (False)."""
        if not keys:
            return True
        manifests = self.tier.manifests(keys)
        req = _Request(req_id, collections.deque(zip(range(len(keys)), keys, manifests)), on_chunk, on_part,
                       len(keys))
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
        on_regions = None if req.on_part is None else (lambda first, rows: req.on_part(index, first, rows))
        try:
            payload = self.tier.decode_form(form, data, on_regions=on_regions)
        except Exception as e:  # noqa: BLE001 — damaged: drop it so it is not offered again
            self.tier.drop_form(key, form)
            return ChunkResult(index, None, e, form, len(data), transmit_s)
        dt = time.perf_counter() - t0
        self.profile.observe(form, dt)
        return ChunkResult(index, payload, None, form, len(data), transmit_s, dt)

    def _finish(self, req: _Request, key: bytes, result: ChunkResult) -> None:
        """A failed non-raw form is retried raw (inline); then the chunk goes to ``on_chunk``."""
        try:
            if result.error is not None and result.form != "raw":
                logger.warning("kvreel: %s form of remote chunk %s failed (%s); fetching it raw",
                               result.form, key.hex()[:16], result.error)
                fetched = self._transfer(result.index, key, "raw")
                result = fetched if isinstance(fetched, ChunkResult) else \
                    self._decode(req, result.index, key, "raw", *fetched)
            req.on_chunk(result)
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
            if form == "raw":
                out.append(Candidate(form, nbytes or 1, decode_s or 0.0))
            elif nbytes > 0 and decode_s is not None:
                out.append(Candidate(form, nbytes, decode_s))
        return out

    def choose_form(self, forms: dict[str, int], previous: str | None) -> str:
        if self.fixed_form is not None:
            return self.fixed_form if self.fixed_form in forms else "raw"
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
