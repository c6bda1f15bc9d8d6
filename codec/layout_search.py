"""Intra-frame tiling search (KVFetcher §3.2), run once per model shape and cached.

Each candidate tiling is encoded on a sample of the chunk (lossless, so size is
the only criterion) and the smallest wins. Results are cached in memory and in
``~/.cache/kvreel/layouts.json`` keyed by (layers, heads, head_dim, byte planes).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from kvreel.codec import layout as lay
from kvreel.codec import video_cpu
from kvreel.codec.cache import cache_file, read_json, write_json

SAMPLE_TOKENS = 256
_memo: dict[str, dict] = {}
_lock = threading.Lock()


def cache_path() -> Path:
    return cache_file("layouts.json")


def _key(samples: torch.Tensor) -> str:
    L, _, B, T, H, D = samples.shape
    return f"L{L}-H{H}-D{D}-B{B}"


def search(samples: torch.Tensor, resolution: int, preset: str = "fast",
           progress=None) -> tuple[lay.Tiling, dict[str, int]]:
    """Try every candidate on up to SAMPLE_TOKENS tokens of the first layers; (best, sizes).
    ``progress``: wraps the candidate list (e.g. ``tqdm``)."""
    L, _, B, T, H, D = samples.shape
    part = samples[: min(L, 3), :, :, : min(T, SAMPLE_TOKENS)]
    sizes = {}
    candidates = lay.candidate_tilings(H, D)
    for tiling in (progress(candidates) if progress else candidates):
        geo = lay.geometry("tiled", resolution, part.shape[3], H, D, tiling)
        total = 0
        for kv in range(2):
            for b in range(B):
                planes = [lay.stream_frames(part[c, kv, b], geo, tiling) if c < part.shape[0]
                          else torch.zeros((geo.frames, geo.height, geo.width), dtype=torch.uint8)
                          for c in range(3)]
                frames = torch.stack(planes, 1).numpy()
                total += len(video_cpu.encode_frames(list(frames), geo.width, geo.height, preset=preset))
        sizes[f"{tiling.head_rows}x{tiling.fold}"] = total
    best = min(lay.candidate_tilings(H, D), key=lambda t: sizes[f"{t.head_rows}x{t.fold}"])
    return best, sizes


def best_tiling(samples: torch.Tensor, resolution: int, preset: str = "fast", *, refresh: bool = False,
                progress=None) -> lay.Tiling:
    """The cached tiling for this model shape, searched (and cached) on a miss or ``refresh``."""
    key = _key(samples)
    with _lock:
        if key not in _memo:
            _memo.update(read_json(cache_path()))
        hit = None if refresh else _memo.get(key)
    if hit is not None:
        return lay.Tiling(**hit)
    best, _ = search(samples, resolution, preset, progress)
    with _lock:
        _memo[key] = best.as_dict()
        try:
            write_json(cache_path(), _memo)
        except OSError:
            pass   # an unwritable cache only costs a re-search
    return best
