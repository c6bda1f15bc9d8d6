"""A pool of chunk decoders: several chunks in flight at once.

Each worker thread decodes whole chunks with ``kvreel.codec.decode_chunk``; on a
GPU every worker drives its own NVDEC session (an H100 has 7 NVDEC engines), on
the CPU FFmpeg's decoder releases the GIL, so threads decode in parallel too.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvreel.codec import decode_chunk


class DecoderPool:
    def __init__(self, workers: int = 4, device: str | torch.device = "cpu", decoder: str = "auto"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.device = torch.device(device)
        self.decoder = decoder
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvreel-decode")
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def load(self) -> float:
        """Chunks queued or decoding per worker (the fetcher's decoder-load input)."""
        return self._in_flight / self.workers

    def submit(self, data: bytes, *, resolution: int | None = None, out: torch.Tensor | None = None) -> Future:
        """Decode one codec container."""
        return self.run(decode_chunk, data, resolution=resolution, out=out, device=self.device, decoder=self.decoder)

    def run(self, fn, *args, **kwargs) -> Future:
        """Run any decode step (a stored form of a chunk, say) on the pool, counted in ``load``."""
        with self._lock:
            self._in_flight += 1
        fut = self._pool.submit(self._call, fn, args, kwargs)
        fut.add_done_callback(self._done)
        return fut

    def _call(self, fn, args, kwargs):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        return fn(*args, **kwargs)

    def _done(self, _fut) -> None:
        with self._lock:
            self._in_flight -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
