"""What kvreel stores, byte for byte: every stored format, its error, the
names of the stored forms, the store keys and the disk paths, in one place.

Every format opens the same way (a *frame*)::

    magic (4 bytes) | u16 version | u32 header_len | header (JSON) | u32 crc32(header) | sections...

* ``CHUNK_FILE`` (``KVRL``): a chunk of paged KV exactly as the engine laid it
  out. The disk tier's files and the remote tier's ``raw`` form. Header: the
  model/layout identity, the chunk's block hashes, the payload shape and the
  payload's CRC-32; one section, the payload.
* ``VIDEO`` (``KVRC``): the codec's lossless-video container
  (``kvreel.codec.container``), the remote tier's ``video@<resolution>`` forms.
* ``LMCACHE_OBJECT`` (``KVRO``): one LMCache object stored by kvreel's LMCache
  serde (``kvreel.connector.lmcache.kv_object``).

A damaged, truncated or foreign chunk raises ``ChunkError`` before a byte of it
reaches a KV cache; an unreachable one raises ``ChunkUnavailable``. JSON and
raw bytes, never pickle: stored bytes are untrusted input.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")


class ChunkError(ValueError):
    """A stored chunk is damaged, truncated, of an unknown format or of another model/shape."""


class ChunkUnavailable(ChunkError):
    """A chunk could not be read at all (missing, tier disabled, store unreachable):
    a failed load, but not a damaged chunk."""


@dataclass(frozen=True)
class Frame:
    """One framed format: its magic, version and header limit."""
    magic: bytes
    version: int
    max_header_bytes: int
    what: str


CHUNK_FILE = Frame(b"KVRL", 1, 1 << 20, "chunk file")
VIDEO = Frame(b"KVRC", 1, 4 << 20, "chunk")
LMCACHE_OBJECT = Frame(b"KVRO", 1, 1 << 20, "kv object")
FRAMES = (CHUNK_FILE, VIDEO, LMCACHE_OBJECT)


def frame(fmt: Frame, header: bytes) -> bytes:
    """The opening of a stored object: magic, version, the header and its CRC-32."""
    return b"".join([_PREFIX.pack(fmt.magic, fmt.version, len(header)), header, _CRC.pack(zlib.crc32(header))])


def read_frame(read, fmt: Frame) -> bytes:
    """The verified raw header from ``read(n)`` (a file's or a BytesIO's read)."""
    prefix = read(_PREFIX.size)
    if prefix[:4] != fmt.magic:
        raise ChunkError(f"not a kvreel {fmt.what} (bad magic)")
    if len(prefix) < _PREFIX.size:
        raise ChunkError(f"truncated {fmt.what}: no header")
    _, version, hlen = _PREFIX.unpack(prefix)
    if version != fmt.version:
        raise ChunkError(f"unsupported {fmt.what} format version {version}")
    if hlen > fmt.max_header_bytes:
        raise ChunkError(f"{fmt.what} header of {hlen} bytes exceeds the {fmt.max_header_bytes}-byte limit")
    raw = read(hlen)
    crc = read(_CRC.size)
    if len(raw) < hlen or len(crc) < _CRC.size:
        raise ChunkError(f"truncated header ({fmt.what})")
    if _CRC.unpack(crc)[0] != zlib.crc32(raw):
        raise ChunkError(f"{fmt.what} header checksum mismatch")
    return raw


def sniff(head: bytes) -> Frame | None:
    """The format whose magic opens ``head`` (None: not a kvreel object)."""
    return next((f for f in FRAMES if head[:4] == f.magic), None)


def section(data, base: int, offset: int, length: int, crc: int, what: str) -> memoryview:
    """Bytes ``[base + offset, + length)`` of ``data``, checked against their CRC-32."""
    view = memoryview(data)[base + offset: base + offset + length]
    if len(view) != length:
        raise ChunkError(f"truncated: {what} is cut short")
    if zlib.crc32(view) != crc:
        raise ChunkError(f"{what} checksum mismatch (damaged)")
    return view


# -- the chunk file (raw form) ---------------------------------------------------

@dataclass(frozen=True)
class ChunkFileHeader:
    identity: str
    block_hashes: tuple[bytes, ...]
    shape: tuple[int, ...]      # payload as uint8 [regions, blocks, block_bytes]
    payload_crc: int

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_bytes(self) -> bytes:
        return json.dumps({"identity": self.identity, "block_hashes": [h.hex() for h in self.block_hashes],
                           "shape": list(self.shape), "payload_crc": self.payload_crc},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "ChunkFileHeader":
        try:
            d = json.loads(raw)
            return cls(str(d["identity"]), tuple(bytes.fromhex(h) for h in d["block_hashes"]),
                       tuple(int(x) for x in d["shape"]), int(d["payload_crc"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ChunkError(f"unreadable chunk file header: {e}") from None


def encode_chunk_file(identity: str, block_hashes: list[bytes], payload: torch.Tensor) -> list[bytes | memoryview]:
    """The pieces of a chunk file, ready for ``writelines`` (the payload is not copied)."""
    data = memoryview(payload.contiguous().numpy()).cast("B")
    header = ChunkFileHeader(identity, tuple(block_hashes), tuple(payload.shape), zlib.crc32(data))
    return [frame(CHUNK_FILE, header.to_bytes()), data]


def chunk_file_bytes(identity: str, block_hashes: list[bytes], payload: torch.Tensor) -> bytes:
    return b"".join(bytes(p) for p in encode_chunk_file(identity, block_hashes, payload))


def chunk_key(block_hashes) -> bytes:
    """A chunk's key: the SHA-256 of its block hashes. It names exactly one run
    of blocks: two engines that cut a prefix differently (one whose own prefix
    cache held a chunk's first blocks stores only the rest) never share a key
    in the remote store, and a fetched chunk proves it is the one asked for
    (``check_chunk_key``)."""
    return hashlib.sha256(b"".join(block_hashes)).digest()


def check_chunk_key(wanted: bytes | None, found: bytes | None) -> None:
    """Raise ``ChunkError`` unless a chunk fetched under key ``wanted`` holds the
    blocks that key names (``found``: the key its header's blocks give);
    ``wanted`` None checks nothing (a chunk read by path)."""
    if wanted is not None and found != wanted:
        raise ChunkError("the chunk holds other blocks than its key names (stored by another kvreel version, "
                         "or not by kvreel)")


def read_chunk_header(f, identity: str | None) -> ChunkFileHeader:
    """The header of the chunk file open in ``f``; checks the identity unless it is None."""
    header = ChunkFileHeader.from_bytes(read_frame(f.read, CHUNK_FILE))
    if identity is not None and header.identity != identity:
        raise ChunkError(f"chunk belongs to another model/layout ({header.identity}, expected {identity})")
    return header


def read_chunk(f, identity: str) -> tuple[ChunkFileHeader, torch.Tensor]:
    """Read and verify a whole chunk file from a binary stream."""
    header = read_chunk_header(f, identity)
    payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
    view = memoryview(payload.numpy())
    got = f.readinto(view)
    if got != header.payload_bytes or f.read(1):
        raise ChunkError(f"payload is {got}+ bytes, header says {header.payload_bytes}")
    if zlib.crc32(view) != header.payload_crc:
        raise ChunkError("payload checksum mismatch")
    return header, payload.view(header.shape)


# -- stored forms ------------------------------------------------------------------

RAW, ZSTD, VIDEO_FORM = "raw", "zstd", "video"
FORM_KINDS = (RAW, ZSTD, VIDEO_FORM)


def video_form(resolution: int) -> str:
    """The name of the video form at one resolution, e.g. ``video@512``."""
    return f"{VIDEO_FORM}@{resolution}"


def form_kind(name: str) -> str:
    """``raw``, ``zstd`` or ``video`` for a form name such as ``video@512``."""
    return name.split("@", 1)[0]


def form_resolution(name: str) -> int | None:
    return int(name.split("@", 1)[1]) if "@" in name else None


# -- where chunks live ---------------------------------------------------------------

BLOCK_POINTER = struct.Struct("<32sI")
"""A remote block's pointer: its chunk's key and its row in that chunk (one per block,
so a prefix lookup is one MGET however the chunks were cut)."""


class StoreKeys:
    """Keys of one model/layout identity in a shared store. The identity comes
    first, so two models never mix; a quantized video form has keys of its own,
    so an exact reader never finds it. A chunk's forms and manifest carry its
    key as a Redis Cluster hash tag (``{...}``): they live on one node, in one
    slot. Block pointers are found by block hash alone, so each has its own."""

    def __init__(self, identity: str):
        self.identity = identity

    def chunk(self, key: bytes) -> str:
        """The raw form of a chunk."""
        return f"kvreel/{self.identity}/c/{{{key.hex()}}}"

    def block(self, block_hash: bytes) -> str:
        """A block pointer: which chunk and row hold this block."""
        return f"kvreel/{self.identity}/b/{block_hash.hex()}"

    def manifest(self, key: bytes) -> str:
        """The stored forms of a chunk and their sizes."""
        return f"kvreel/{self.identity}/m/{{{key.hex()}}}"

    def form(self, name: str, key: bytes, quant: str = "none") -> str:
        if name == RAW:
            return self.chunk(key)
        suffix = f"-{quant}" if form_kind(name) == VIDEO_FORM and quant != "none" else ""
        return f"kvreel/{self.identity}/{name.replace('@', '')}{suffix}/{{{key.hex()}}}"


def lmcache_object_key(key_string: str, integration: str) -> str:
    """Store key of an LMCache object kept by kvreel: ``integration`` is ``mp``
    (LMCache's multiprocess server, the L2 adapter) or ``v1`` (in-process
    remote-storage plugin); the two name their objects differently."""
    prefix = {"mp": "lmcache", "v1": "lmcache-v1"}[integration]
    return f"kvreel/{prefix}/" + hashlib.sha256(key_string.encode()).hexdigest()


def chunk_dir(root: str | Path, identity: str, rank: int) -> Path:
    """The disk tier's directory for one model/layout identity and worker rank."""
    return Path(root) / identity / f"rank{rank}"


def identity_description_path(root: str | Path, identity: str) -> Path:
    """The JSON beside an identity's chunks naming the model, dtypes and layout it stands for."""
    return Path(root) / identity / "identity.json"


def chunk_path(root: str | Path, identity: str, rank: int, key: bytes) -> Path:
    h = key.hex()
    return chunk_dir(root, identity, rank) / h[:2] / f"{h}.kvr"


def key_of_path(path: Path) -> bytes | None:
    """The chunk key a disk-tier file name encodes (None: not a name kvreel writes)."""
    try:
        return bytes.fromhex(path.stem) if path.suffix == ".kvr" else None
    except ValueError:
        return None
