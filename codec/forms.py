"""A chunk payload ``[regions, blocks, block_bytes]`` in each form the remote
tier stores: the raw chunk file (exact; every fetch can fall back to it), zstd
of that file, and the lossless-video container at each resolution
(``video@256``...). Decoding verifies before it hands anything on."""

from __future__ import annotations

import io
import time
from typing import Callable

import torch
import zstandard

from kvreel.codec.chunk import decode_chunk, encode_chunk, read_header
from kvreel.codec.formats import (RAW, VIDEO_FORM, ZSTD, ChunkError, check_chunk_key, chunk_file_bytes, chunk_key,
                                  form_kind, read_chunk, video_form)


class KVView:
    """The codec's ``[regions, 2, tokens, kv_heads, head_dim]`` view of a chunk
    payload ``[regions, blocks, block_bytes]`` (and back), so the video form can
    lay K and V out by head and channel.

    A page holding ``kv_heads x block_size x (K, V) x head_dim`` elements (vLLM's
    CPU layout) is viewed as such; other packings as two halves of 16-bit
    samples per block. Either way the round trip is byte-exact; only compression
    (and, for int8, which values share a scale) depends on the view."""

    def __init__(self, block_bytes: int, spec) -> None:
        H, D, bs = spec.num_kv_heads, spec.head_size, spec.block_size
        itemsize = torch.empty(0, dtype=spec.dtype).element_size()
        if block_bytes == H * bs * 2 * D * itemsize:
            self.dtype, self.page = spec.dtype, (H, bs, 2, D)
        elif block_bytes % 4 == 0:
            self.dtype, self.page = torch.float16, (1, 1, 2, block_bytes // 4)
        else:
            raise ValueError(f"a {block_bytes}-byte page has no 16-bit K/V view")
        self.block_bytes = block_bytes

    def to_kv(self, payload: torch.Tensor) -> torch.Tensor:
        R, n, _ = payload.shape
        H, bs, two, D = self.page
        kv = payload.contiguous().view(self.dtype).view(R, n, H, bs, two, D)
        return kv.permute(0, 4, 1, 3, 2, 5).reshape(R, 2, n * bs, H, D)

    def to_payload(self, kv: torch.Tensor) -> torch.Tensor:
        R = kv.shape[0]
        H, bs, two, D = self.page
        n = kv.shape[2] // bs
        pages = kv.reshape(R, 2, n, bs, H, D).permute(0, 2, 4, 3, 1, 5)
        return pages.contiguous().view(torch.uint8).view(R, n, self.block_bytes)


class StoredForms:
    """Encode a chunk into every configured form, decode any one of them."""

    def __init__(self, identity: str, *, kinds: tuple[str, ...] = (RAW,), quant: str = "none",
                 resolutions: tuple[int, ...] = (256,), kv_view: KVView | None = None,
                 max_bytes: int = 256 << 20):
        if VIDEO_FORM in kinds and kv_view is None:
            raise ValueError("the video form needs the engine's page geometry")
        self.identity, self.kinds, self.quant, self.resolutions, self.kv_view = \
            identity, kinds, quant, resolutions, kv_view
        self.max_bytes = max_bytes
        self.device = torch.device("cpu")      # the engine's GPU: NVDEC decodes the video form there

    def names(self) -> list[str]:
        """Every form name a chunk is stored in."""
        return [k for k in (RAW, ZSTD) if k in self.kinds] + \
            ([video_form(r) for r in self.resolutions] if VIDEO_FORM in self.kinds else [])

    def encode(self, block_hashes: list[bytes], payload: torch.Tensor,
               seconds: dict[str, float] | None = None) -> dict[str, bytes]:
        """Form name -> stored bytes (and the time each took, added to ``seconds``)."""
        out: dict[str, bytes] = {}
        for name, data, dt in self.encode_each(block_hashes, payload, self.names()):
            out[name] = data
            if seconds is not None:
                seconds[name] = seconds.get(name, 0.0) + dt
        return out

    def encode_each(self, block_hashes: list[bytes], payload: torch.Tensor, names: list[str]):
        """Yield ``(name, stored bytes, seconds)`` for each of ``names`` in turn,
        so a caller can store the cheap forms before the slow ones are encoded."""
        raw = None
        kv = None
        for name in names:
            t0 = time.perf_counter()
            if name in (RAW, ZSTD):
                if raw is None:
                    raw = chunk_file_bytes(self.identity, block_hashes, payload)
                data = raw if name == RAW else zstandard.ZstdCompressor(level=3).compress(raw)
            else:
                if kv is None:
                    kv = self.kv_view.to_kv(payload)
                data = encode_chunk(kv, quant=self.quant, resolutions=(int(name.split("@")[1]),),
                                    model=self.identity, chunk_key=chunk_key(block_hashes))
            yield name, data, time.perf_counter() - t0

    def decode(self, name: str, data: bytes, payload_shape: tuple[int, ...] | None = None,
               on_regions: Callable[[int, torch.Tensor], None] | None = None,
               key: bytes | None = None) -> torch.Tensor:
        """The verified payload from one stored form (on ``device`` for the video
        form, on the CPU otherwise); with ``key``, a chunk whose blocks are not the
        ones that key names is refused before a row is handed on. ``on_regions(first, rows)`` receives
        verified payload rows as soon as they are decoded: the video form hands
        on each layer triplet while later frames are still decoding, the byte
        forms the whole chunk at once."""
        kind = form_kind(name)
        if kind == ZSTD:
            try:
                data = zstandard.ZstdDecompressor().decompress(data, max_output_size=self.max_bytes)
            except zstandard.ZstdError as e:
                raise ChunkError(f"zstd form: {e}") from None
        if kind in (RAW, ZSTD):
            header, payload = read_chunk(io.BytesIO(data), self.identity)
            check_chunk_key(key, chunk_key(header.block_hashes))
            if on_regions is not None:
                on_regions(0, payload)
            return payload
        if kind != VIDEO_FORM or self.kv_view is None:
            raise ChunkError(f"unknown or unconfigured stored form {name!r}")
        header = read_header(data)
        if header.model != self.identity:
            raise ChunkError("video form belongs to another model/layout")
        if header.quant != self.quant:
            raise ChunkError(f"video form is quantized {header.quant!r}, this engine wants {self.quant!r}")
        check_chunk_key(key, _hex_key(header.chunk_key))
        hand_on = None if on_regions is None else (
            lambda first, layers: on_regions(first, self.kv_view.to_payload(layers)))
        try:
            kv = decode_chunk(data, device=self.device, on_layers=hand_on)
        except ChunkError as e:
            raise ChunkError(f"{name} form: {e}") from None
        payload = self.kv_view.to_payload(kv)
        if payload_shape is not None and tuple(payload.shape) != tuple(payload_shape):
            raise ChunkError(f"{name} form decodes to {tuple(payload.shape)}, expected {tuple(payload_shape)}")
        return payload


def _hex_key(text) -> bytes | None:
    """A key written in a (untrusted) header, or None where it is absent or unreadable."""
    try:
        return bytes.fromhex(text)
    except (TypeError, ValueError):
        return None
