"""encode_chunk / decode_chunk: a KV chunk <-> a multi-resolution lossless-video container."""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

import numpy as np
import torch

from kvreel.codec import layout as lay
from kvreel.codec import video_cpu
from kvreel.codec.container import ChunkHeader, Section, Stream, pack, section_bytes, unpack_header
from kvreel.codec.formats import ChunkError
from kvreel.codec.layout_search import best_tiling
from kvreel.codec.quant import DTYPES, QUANTS, byte_planes, restore_tokens, to_samples

DEFAULT_RESOLUTIONS = (256, 512)
LAYOUTS = ("auto", "naive")


def _streams(L: int, B: int):
    """(layer triplet g, K/V, byte plane) in stream order."""
    for g in range(-(-L // 3)):
        for kv in range(2):
            for b in range(B):
                yield g, kv, b


def encode_chunk(kv: torch.Tensor, *, quant: str = "none", layout: str = "auto",
                 resolutions: Sequence[int] | None = None, preset: str = "fast", token_start: int = 0,
                 block_size: int | None = None, model: str | None = None, encoder: str = "auto",
                 chunk_key: bytes | None = None) -> bytes:
    """KV ``[layers, 2, tokens, kv_heads, head_dim]`` -> container bytes.

    ``quant``: "none" (bit-exact) or "int8"; ``layout``: "auto" (searched
    token-sliced tiling, cached per model shape) or "naive"; each resolution
    (frame side in samples) is encoded as its own bitstream. ``encoder``: "auto"
    (NVENC where the GPU has one, else libx265), "nvenc" or "cpu"; every
    bitstream is decoded once before it is accepted, so it is lossless."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, tokens, kv_heads, head_dim], got {tuple(kv.shape)}")
    dtype_name = next((n for n, d in DTYPES.items() if d == kv.dtype), None)
    if dtype_name is None:
        raise ValueError(f"kv dtype must be one of {sorted(DTYPES)}, got {kv.dtype}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if encoder not in ("auto", "nvenc", "cpu"):
        raise ValueError(f"encoder must be auto, nvenc or cpu, got {encoder!r}")
    use_nvenc = encoder == "nvenc" or (encoder == "auto" and _nvenc_available())
    resolutions = tuple(resolutions or DEFAULT_RESOLUTIONS)
    if any(r < 16 for r in resolutions):
        raise ValueError(f"resolutions must be >= 16 samples, got {resolutions}")
    kv = kv.detach().cpu()
    L, _, T, H, D = kv.shape
    samples, params = to_samples(kv, quant)                 # [L, 2, B, T, H, D] uint8
    B = samples.shape[2]
    tiling = best_tiling(samples, resolutions[0], preset) if layout == "auto" else None
    sections: list[bytes] = []
    offset = 0
    params_section = None
    if params is not None:
        raw = params.contiguous().numpy().tobytes()
        params_section = Section(offset, len(raw), zlib.crc32(raw))
        sections.append(raw)
        offset += len(raw)
    streams = []
    for res in resolutions:
        geo = lay.geometry("naive" if tiling is None else "tiled", res, T, H, D, tiling)
        frames, sums = frames_of(samples, geo, tiling, L, B)
        bitstream = video_cpu.encode_frames_verified(frames, geo.width, geo.height, preset=preset,
                                                     use_nvenc=use_nvenc)
        streams.append(Stream(res, geo.__dict__, Section(offset, len(bitstream), zlib.crc32(bitstream)), sums))
        sections.append(bitstream)
        offset += len(bitstream)
    header = ChunkHeader([L, T, H, D], dtype_name, quant, layout,
                         tiling.as_dict() if tiling else None, params_section, streams, token_start, block_size, model,
                         chunk_key.hex() if chunk_key is not None else None)
    return pack(header, sections)


def frames_of(samples: torch.Tensor, geo: lay.FrameGeometry, tiling, L: int, B: int):
    """All frames of a resolution in stream order, and their checksums."""
    frames, sums = [], []
    for g, kv, b in _streams(L, B):
        planes = []
        for c in range(3):
            layer = 3 * g + c
            if layer < L:
                planes.append(lay.stream_frames(samples[layer, kv, b], geo, tiling))
            else:
                planes.append(torch.zeros((geo.frames, geo.height, geo.width), dtype=torch.uint8))
        stacked = torch.stack(planes, dim=1).numpy()           # [F, 3, height, width]
        for f in range(geo.frames):
            frames.append(stacked[f])
            sums.append(frame_checksum(torch.from_numpy(stacked[f])))
    return frames, sums


_WEIGHTS: dict[tuple, torch.Tensor] = {}


def frame_checksum(frame: torch.Tensor) -> int:
    """Position-weighted sum of a decoded frame's samples mod 2**61-1: computed
    where the frame lives (NVDEC frames never leave the GPU for it) and checked
    once per chunk. The bitstream's CRC-32 guards transport; this guards decoding."""
    return int(_checksum_tensor(frame))


def _checksum_tensor(frame: torch.Tensor) -> torch.Tensor:
    key = (frame.numel(), frame.device)
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = torch.arange(frame.numel(), device=frame.device, dtype=torch.int64) % 65521 + 1
    return (frame.reshape(-1).to(torch.int64) * w).sum() % (2**61 - 1)


def read_header(data: bytes | memoryview) -> ChunkHeader:
    return unpack_header(data)[0]


def decode_chunk(data: bytes | memoryview, *, resolution: int | None = None, out: torch.Tensor | None = None,
                 device: str | torch.device = "cpu", decoder: str = "auto",
                 on_layers: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Container bytes -> KV ``[layers, 2, tokens, kv_heads, head_dim]`` (into ``out`` when given).

    Frames are restored into the destination one at a time (no chunk-sized
    intermediate). The bitstream's CRC is checked before the first write, so a
    damaged chunk raises ChunkError and leaves ``out`` untouched. The frames of
    each layer triplet are checked as soon as its K and V are complete, and
    ``on_layers(first, out[first:stop])`` is then called, so a caller can move those
    layers on while later frames are still decoding; a damaged frame raises
    ChunkError before its layers are handed on. ``decoder`` is "auto" (NVDEC
    when decoding to a GPU with PyNvVideoCodec), "nvdec" or "cpu"."""
    header, base = unpack_header(data)
    L, T, H, D = header.shape
    dtype = DTYPES.get(header.dtype)
    if dtype is None or header.quant not in QUANTS or header.layout not in LAYOUTS:
        raise ChunkError(f"unknown dtype/quant/layout {header.dtype}/{header.quant}/{header.layout}")
    if out is not None:
        want = (L, 2, T, H, D)
        if tuple(out.shape) != want or out.dtype != dtype:
            raise ChunkError(f"chunk holds KV of shape {want} {header.dtype}, destination is "
                             f"{tuple(out.shape)} {str(out.dtype).replace('torch.', '')}: wrong model shape")
    stream = _pick(header, resolution)
    bitstream = section_bytes(data, base, stream.bitstream, f"bitstream at resolution {stream.resolution}")
    params = None
    if header.params is not None:
        raw = section_bytes(data, base, header.params, "quantizer parameters")
        params = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).view(L, 2, 2, H, D)
    tiling = lay.Tiling(**header.tiling) if header.tiling else None
    geo = lay.FrameGeometry(**stream.geometry)
    B = byte_planes(dtype, header.quant)
    per_triplet = 2 * B * geo.frames
    expected = -(-L // 3) * per_triplet
    if len(stream.frame_sums) != expected:
        raise ChunkError(f"chunk lists {len(stream.frame_sums)} frames, its geometry needs {expected}")
    if out is None:
        out = torch.empty((L, 2, T, H, D), dtype=dtype, device=device)
    use_nvdec = decoder == "nvdec" or (decoder == "auto" and out.device.type == "cuda" and _nvdec_available())
    frames = _decode_iter(bytes(bitstream), use_nvdec, out.device)
    order = [(g, kv, b, f) for g, kv, b in _streams(L, B) for f in range(geo.frames)]
    n = -1
    checks: list[torch.Tensor] = []
    for n, frame in enumerate(frames):
        if n >= len(order):
            raise ChunkError("bitstream holds more frames than the header lists")
        g, kv, b, f = order[n]
        if frame.shape != (3, geo.height, geo.width):
            raise ChunkError(f"decoded frame is {tuple(frame.shape)}, expected {(3, geo.height, geo.width)}")
        planes = frame if isinstance(frame, torch.Tensor) else torch.from_numpy(frame)
        checks.append(_checksum_tensor(planes))
        for c in range(3):
            layer = 3 * g + c
            if layer >= L:
                continue
            tokens, values = lay.frame_tokens(planes[c], f, geo, tiling, T, H, D)
            restore_tokens(out, layer, kv, b, tokens.to(out.device), values, header.quant, params)
        if (n + 1) % per_triplet == 0:
            _verify(checks, stream.frame_sums, n + 1 - per_triplet)      # one device sync per triplet
            checks = []
            if on_layers is not None:
                on_layers(3 * g, out[3 * g:3 * g + 3])
    if n + 1 != len(order):
        raise ChunkError(f"bitstream ended after {n + 1} of {len(order)} frames")
    return out


def _verify(checks: list[torch.Tensor], sums: list[int], first: int) -> None:
    got = torch.stack(checks).cpu().tolist()
    bad = [first + i for i, (a, b) in enumerate(zip(got, sums[first:])) if a != b]
    if bad:
        raise ChunkError(f"{len(bad)} decoded frame(s) failed their checksum (first: frame {bad[0]})")


def _pick(header: ChunkHeader, resolution: int | None) -> Stream:
    if not header.streams:
        raise ChunkError("chunk holds no bitstream")
    if resolution is None:
        return header.streams[0]
    for s in header.streams:
        if s.resolution == resolution:
            return s
    raise ChunkError(f"chunk has no resolution {resolution} (has {[s.resolution for s in header.streams]})")


def _nvenc_available() -> bool:
    from kvreel.codec import video_nvenc
    return video_nvenc.available()


def _nvdec_available() -> bool:
    from kvreel.codec import video_nvdec
    return video_nvdec.available()


def _decode_iter(bitstream: bytes, use_nvdec: bool, device):
    try:
        if use_nvdec:
            from kvreel.codec import video_nvdec
            yield from video_nvdec.decode_frames(bitstream, device.index or 0)
        else:
            yield from video_cpu.decode_frames(bitstream)
    except ValueError as e:
        raise ChunkError(str(e)) from None
