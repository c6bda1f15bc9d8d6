"""kvreel's stored form of one LMCache KV object (one chunk of tokens).

    frame "KVRO" (kvreel.codec.formats.LMCACHE_OBJECT; JSON: key, one entry per kernel group) | sections...

Each group of the object (LMCache's ``[2, layers, tokens, hidden]`` KV, or any
other tensor such as MLA's ``[layers, tokens, hidden]``) becomes one section:

* ``video``: a kvreel codec container (quantize -> layout -> lossless HEVC,
  several resolutions, per-bitstream CRC and per-frame checksums);
* ``zstd``: the zstd-compressed bytes (CRC-32 of the raw bytes);
* ``raw``: the bytes as they are (CRC-32).

Groups that are not K/V shaped fall back from ``video`` to ``zstd``. The key
string is stored in the header, so an object read under the wrong key (a hash
collision in the store's key space, a foreign writer) is refused. Everything is
verified before the first byte of the destination is written. JSON + bytes,
never pickle: objects come from shared stores.
"""

from __future__ import annotations

import io
import json
import zlib
from typing import Sequence

import torch

from kvreel.codec import ChunkError, decode_chunk, encode_chunk
from kvreel.codec.formats import LMCACHE_OBJECT, RAW, VIDEO_FORM, ZSTD, frame, read_frame
from kvreel.codec.quant import DTYPES, QUANTS

FORMS = (VIDEO_FORM, ZSTD, RAW)      # the serde's choice, best compression first

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_kv(t: torch.Tensor) -> torch.Tensor | None:
    """LMCache's ``[2, layers, tokens, hidden]`` as the codec's
    ``[layers, 2, tokens, 1, hidden]``; None for other shapes and dtypes."""
    if t.dim() == 4 and t.shape[0] == 2 and t.dtype in DTYPES.values():
        return t.permute(1, 0, 2, 3).unsqueeze(3)
    return None


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise ImportError("the 'zstd' form needs the zstandard package (pip install zstandard)") from None
    return zstandard


def group_tensors(obj) -> list[torch.Tensor]:
    """An LMCache MemoryObj's tensors, one per kernel group."""
    shapes = obj.get_shapes()
    return [obj.tensor] if len(shapes) == 1 else [obj.get_tensor(i) for i in range(len(shapes))]


def check_options(form: str, quant: str) -> None:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if quant != "none" and form != VIDEO_FORM:
        raise ValueError(f"quant={quant!r} needs form='video' (zstd and raw are exact)")


def encode_object(key: str, groups: Sequence[torch.Tensor], *, form: str = VIDEO_FORM, quant: str = "none",
                  resolutions: Sequence[int] | None = None, encoder: str = "auto") -> bytes:
    check_options(form, quant)
    entries, sections = [], []
    for t in groups:
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        kv = _as_kv(t) if form == VIDEO_FORM else None
        if kv is not None:
            data, used = encode_chunk(kv, quant=quant, resolutions=resolutions, encoder=encoder), VIDEO_FORM
        elif form == RAW:
            data, used = raw, RAW
        else:
            data, used = _zstd().ZstdCompressor(level=3).compress(raw), ZSTD
        entries.append({"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "form": used,
                        "length": len(data), "scrc": zlib.crc32(data),
                        "crc": zlib.crc32(raw) if used != VIDEO_FORM else None})
        sections.append(data)
    header = json.dumps({"key": key, "groups": entries}, separators=(",", ":")).encode()
    return b"".join([frame(LMCACHE_OBJECT, header), *sections])


def _read_header(data) -> tuple[dict, int]:
    stream = io.BytesIO(memoryview(data)[: LMCACHE_OBJECT.max_header_bytes + 64])
    raw = read_frame(stream.read, LMCACHE_OBJECT)
    try:
        header = json.loads(raw)
        for g in header["groups"]:
            int(g["length"])
    except (ValueError, KeyError, TypeError) as e:
        raise ChunkError(f"unreadable kv object header: {e}") from None
    return header, stream.tell()


def object_length(data) -> int | None:
    """Total length of the kvreel object at the start of ``data``; None if
    ``data`` does not start with one (used to store serde buffers at their real size)."""
    if bytes(memoryview(data)[:4]) != LMCACHE_OBJECT.magic:
        return None
    try:
        header, base = _read_header(data)
    except ChunkError:
        return None
    return base + sum(int(g["length"]) for g in header["groups"])


def verify_object(data, key: str) -> list[tuple[dict, memoryview]]:
    """Check the header, the key and every section's checksum (cheap: no decoding);
    the (group entry, section) pairs."""
    header, base = _read_header(data)
    if header.get("key") != key:
        raise ChunkError(f"kv object belongs to key {str(header.get('key'))[:80]!r}, not {key[:80]!r}")
    view, offset, out = memoryview(data), base, []
    for g in header["groups"]:
        section = view[offset: offset + int(g["length"])]
        offset += int(g["length"])
        if len(section) != int(g["length"]):
            raise ChunkError("truncated kv object")
        if zlib.crc32(section) != g.get("scrc"):
            raise ChunkError(f"kv object {g.get('form')} section checksum mismatch (damaged object)")
        out.append((g, section))
    return out


def decode_object(data, key: str, out: Sequence[torch.Tensor], *, device: str | torch.device = "cpu") -> None:
    """Verify ``data`` fully, then write its groups into ``out`` (same shapes/dtypes)."""
    sections = verify_object(data, key)
    if len(sections) != len(out):
        raise ChunkError(f"kv object has {len(sections)} groups, the destination {len(out)}")
    decoded = []
    for (g, section), dst in zip(sections, out):
        if list(dst.shape) != list(g["shape"]) or g.get("dtype") != _dtype_name(dst.dtype):
            raise ChunkError(f"kv object group is {g['shape']} {g.get('dtype')}, "
                                f"the destination {list(dst.shape)} {dst.dtype}")
        decoded.append(_decode_group(g, section, dst, device))
    for src, dst in zip(decoded, out):
        dst.copy_(src)


def _decode_group(g: dict, section: memoryview, dst: torch.Tensor, device) -> torch.Tensor:
    form = g.get("form")
    if form == VIDEO_FORM:
        try:
            kv = decode_chunk(section, device=device)
        except ChunkError as e:
            raise ChunkError(f"kv object video section: {e}") from None
        expect = _as_kv(torch.empty(dst.shape, dtype=dst.dtype, device="meta"))
        if expect is None or tuple(kv.shape) != tuple(expect.shape) or kv.dtype != dst.dtype:
            raise ChunkError(f"kv object video section is {tuple(kv.shape)}, expected {dst.shape}")
        return kv.squeeze(3).permute(1, 0, 2, 3)
    if form == ZSTD:
        try:
            raw = _zstd().ZstdDecompressor().decompress(section, max_output_size=dst.numel() * dst.element_size())
        except _zstd().ZstdError as e:
            raise ChunkError(f"kv object zstd section: {e}") from None
    elif form == RAW:
        raw = section
    else:
        raise ChunkError(f"unknown kv object form {form!r}")
    if len(raw) != dst.numel() * dst.element_size() or zlib.crc32(raw) != g.get("crc"):
        raise ChunkError(f"kv object {form} section checksum mismatch (damaged object)")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dst.dtype).view(dst.shape) \
        if len(raw) else torch.empty(dst.shape, dtype=dst.dtype)


def object_groups(data) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of each group, from a verified header."""
    header, _ = _read_header(data)
    out = []
    for g in header["groups"]:
        dtype = getattr(torch, str(g.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ChunkError(f"kv object group has an unknown dtype {str(g.get('dtype'))[:40]!r}")
        out.append((torch.Size(int(x) for x in g["shape"]), dtype))
    return out
