"""The self-describing chunk container.

    b"KVRC" | u16 version | u32 header_len | header (JSON) | u32 crc32(header) | sections...

The header records the model shape (layers, KV heads, head_dim, dtype, block
size), token range, quantizer and its parameter section, layout and tiling, and
for every encoded resolution the frame geometry, the byte range and CRC-32 of
its bitstream and a checksum per decoded frame. Sections follow the header in the
order the header lists them, so a fetcher can read one resolution with a range
request. JSON, never pickle: containers arrive from remote stores.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field

MAGIC = b"KVRC"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")
MAX_HEADER_BYTES = 4 << 20


class ChunkError(ValueError):
    """A chunk is damaged, truncated, of an unknown format or of another model shape."""


@dataclass
class Section:
    offset: int       # from the end of the header
    length: int
    crc: int


@dataclass
class Stream:
    resolution: int
    geometry: dict
    bitstream: Section
    frame_sums: list[int] = field(default_factory=list)


@dataclass
class ChunkHeader:
    shape: list[int]            # [layers, tokens, kv_heads, head_dim]
    dtype: str
    quant: str
    layout: str
    tiling: dict | None
    params: Section | None
    streams: list[Stream]
    token_start: int = 0
    block_size: int | None = None
    model: str | None = None

    def to_json(self) -> bytes:
        def enc(o):
            return o.__dict__ if hasattr(o, "__dict__") else o
        return json.dumps(self, default=enc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "ChunkHeader":
        try:
            d = json.loads(raw)
            params = Section(**d["params"]) if d.get("params") else None
            streams = [Stream(s["resolution"], dict(s["geometry"]), Section(**s["bitstream"]),
                              [int(c) for c in s["frame_sums"]]) for s in d["streams"]]
            return cls([int(x) for x in d["shape"]], str(d["dtype"]), str(d["quant"]), str(d["layout"]),
                       d.get("tiling"), params, streams, int(d.get("token_start", 0)), d.get("block_size"),
                       d.get("model"))
        except (ValueError, KeyError, TypeError) as e:
            raise ChunkError(f"unreadable chunk header: {e}") from None


def pack(header: ChunkHeader, sections: list[bytes]) -> bytes:
    raw = header.to_json()
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(raw)), raw, _CRC.pack(zlib.crc32(raw)), *sections])


def unpack_header(data: bytes | memoryview) -> tuple[ChunkHeader, int]:
    """(header, offset of the first section)."""
    data = memoryview(data)
    if len(data) < _PREFIX.size:
        raise ChunkError("truncated chunk: no header")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ChunkError("not a kvreel chunk (bad magic)")
    if version != VERSION:
        raise ChunkError(f"unsupported chunk format version {version}")
    if hlen > MAX_HEADER_BYTES:
        raise ChunkError(f"chunk header of {hlen} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    end = _PREFIX.size + hlen
    if len(data) < end + _CRC.size:
        raise ChunkError("truncated chunk header")
    raw = bytes(data[_PREFIX.size:end])
    if _CRC.unpack_from(data, end)[0] != zlib.crc32(raw):
        raise ChunkError("chunk header checksum mismatch")
    return ChunkHeader.from_json(raw), end + _CRC.size


def section_bytes(data: bytes | memoryview, base: int, section: Section, what: str) -> memoryview:
    view = memoryview(data)[base + section.offset: base + section.offset + section.length]
    if len(view) != section.length:
        raise ChunkError(f"truncated chunk: {what} is cut short")
    if zlib.crc32(view) != section.crc:
        raise ChunkError(f"{what} checksum mismatch (damaged chunk)")
    return view
