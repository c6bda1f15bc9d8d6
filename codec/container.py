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

import io
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


def framed_header(magic: bytes, version: int, raw: bytes) -> bytes:
    """``magic | u16 version | u32 len | raw | u32 crc32(raw)``: how kvreel's
    containers and disk chunk files both open."""
    return b"".join([_PREFIX.pack(magic, version, len(raw)), raw, _CRC.pack(zlib.crc32(raw))])


def read_framed_header(read, magic: bytes, version: int, limit: int, error: type[Exception], what: str) -> bytes:
    """The verified raw header from ``read(n)`` (a file's or BytesIO's read)."""
    prefix = read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise error(f"truncated {what}: no header")
    got_magic, got_version, hlen = _PREFIX.unpack(prefix)
    if got_magic != magic:
        raise error(f"not a kvreel {what} (bad magic)")
    if got_version != version:
        raise error(f"unsupported {what} format version {got_version}")
    if hlen > limit:
        raise error(f"{what} header of {hlen} bytes exceeds the {limit}-byte limit")
    raw = read(hlen)
    crc = read(_CRC.size)
    if len(raw) < hlen or len(crc) < _CRC.size:
        raise error(f"truncated header ({what})")
    if _CRC.unpack(crc)[0] != zlib.crc32(raw):
        raise error(f"{what} header checksum mismatch")
    return raw


def pack(header: ChunkHeader, sections: list[bytes]) -> bytes:
    return b"".join([framed_header(MAGIC, VERSION, header.to_json()), *sections])


def unpack_header(data: bytes | memoryview) -> tuple[ChunkHeader, int]:
    """(header, offset of the first section)."""
    stream = io.BytesIO(data)
    raw = read_framed_header(stream.read, MAGIC, VERSION, MAX_HEADER_BYTES, ChunkError, "chunk")
    return ChunkHeader.from_json(raw), stream.tell()


def section_bytes(data: bytes | memoryview, base: int, section: Section, what: str) -> memoryview:
    view = memoryview(data)[base + section.offset: base + section.offset + section.length]
    if len(view) != section.length:
        raise ChunkError(f"truncated chunk: {what} is cut short")
    if zlib.crc32(view) != section.crc:
        raise ChunkError(f"{what} checksum mismatch (damaged chunk)")
    return view
