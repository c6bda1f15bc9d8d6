"""The self-describing chunk container.

    frame "KVRC" (kvreel.codec.formats.VIDEO) | sections...

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
from dataclasses import dataclass, field

from kvreel.codec.formats import VIDEO, ChunkError, frame, read_frame, section

__all__ = ["ChunkError", "ChunkHeader", "Section", "Stream", "pack", "unpack_header", "section_bytes"]


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
    chunk_key: str | None = None   # hex of kvreel.codec.formats.chunk_key of the blocks it holds

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
                       d.get("model"), d.get("chunk_key"))
        except (ValueError, KeyError, TypeError) as e:
            raise ChunkError(f"unreadable chunk header: {e}") from None


def pack(header: ChunkHeader, sections: list[bytes]) -> bytes:
    return b"".join([frame(VIDEO, header.to_json()), *sections])


def unpack_header(data: bytes | memoryview) -> tuple[ChunkHeader, int]:
    """(header, offset of the first section)."""
    stream = io.BytesIO(data)
    raw = read_frame(stream.read, VIDEO)
    return ChunkHeader.from_json(raw), stream.tell()


def section_bytes(data: bytes | memoryview, base: int, sec: Section, what: str) -> memoryview:
    return section(data, base, sec.offset, sec.length, sec.crc, what)
