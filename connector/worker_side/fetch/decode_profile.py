"""How long each stored form of a chunk takes to decode on this machine.

The fetch controller needs decode time per form and resolution (KVFetcher
Alg. 1's profile table). It is measured once per machine, decoder and chunk
shape by encoding a synthetic KV-like chunk into every form and timing its
decode, cached in ``~/.cache/kvreel/decode_profile.json`` (``kvreel.codec.cache``), and refined by every
real decode (EWMA), so it follows the machine's actual load.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from kvreel.codec.cache import cache_file, read_json, write_json

logger = logging.getLogger(__name__)
_DEFAULT = object()


class DecodeProfile:
    """Seconds to decode one chunk, per form (``raw``, ``zstd``, ``video@512``...)."""

    def __init__(self, machine_key: str, path: Path | None = _DEFAULT, alpha: float = 0.3):
        """``path``: the cache file (default ``decode_profile.json`` in kvreel's cache; None: no cache)."""
        self.machine_key, self.alpha = machine_key, alpha
        self.path = cache_file("decode_profile.json") if path is _DEFAULT else path
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = self._load()

    def _load(self) -> dict[str, float]:
        if self.path is None:
            return {}
        try:
            table = read_json(self.path).get(self.machine_key, {})
            return {str(k): float(v) for k, v in table.items() if float(v) > 0}
        except (ValueError, AttributeError, TypeError):
            return {}

    def save(self) -> None:
        if self.path is None:
            return
        table = read_json(self.path)
        with self._lock:
            table[self.machine_key] = dict(self.seconds)
        try:
            write_json(self.path, table)
        except OSError as e:
            logger.warning("kvreel: could not cache the decode profile (%s)", e)

    def get(self, form: str) -> float | None:
        with self._lock:
            return self.seconds.get(form)

    def observe(self, form: str, seconds: float) -> None:
        with self._lock:
            old = self.seconds.get(form)
            self.seconds[form] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def measure(self, forms: list[str], encode: Callable[[], dict[str, bytes]],
                decode: Callable[[str, bytes], object], repeats: int = 3) -> None:
        """Time ``decode(form, data)`` on ``encode()``'s output for forms not yet profiled."""
        missing = [f for f in forms if self.get(f) is None]
        if not missing:
            return
        try:
            self._measure(missing, encode, decode, repeats)
        except Exception as e:  # noqa: BLE001 — profiling must never take the engine down
            logger.warning("kvreel: decode profiling failed (%s); forms without a profile are not chosen", e)

    def _measure(self, missing, encode, decode, repeats) -> None:
        encoded = encode()
        for form in missing:
            if form not in encoded:
                continue
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                decode(form, encoded[form])
                times.append(time.perf_counter() - t0)
            with self._lock:
                self.seconds[form] = sorted(times)[len(times) // 2]
        self.save()
        logger.info("kvreel: decode profile %s", {f: round(s * 1e3, 2) for f, s in self.seconds.items()})


def synthetic_payload(like: torch.Size, seed: int = 0) -> torch.Tensor:
    """A payload of KV-like values (smooth along tokens): profiling input shaped like real chunks."""
    g = torch.Generator().manual_seed(seed)
    R, n, nbytes = like
    base = torch.randn(R, 1, nbytes // 2, generator=g)
    values = base + 0.05 * torch.randn(R, n, nbytes // 2, generator=g)
    return values.to(torch.bfloat16).view(torch.uint8).contiguous()
