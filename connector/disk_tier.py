"""Disk tier: one self-checking file per stored chunk.

File layout (little endian; the framing is shared with kvreel.codec's container)::

    b"KVRL" | u16 version | u32 header_len | header (JSON, UTF-8) | u32 crc32(header) | payload

The header names the model/layout identity, the chunk's block hashes, the
payload shape and the payload's CRC-32, so a corrupted, truncated or foreign
file is recognised before a single byte reaches the KV cache. JSON, never
pickle: files on disk are untrusted input.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from kvreel.codec.container import framed_header, read_framed_header

logger = logging.getLogger("kvreel.disk")

MAGIC = b"KVRL"
VERSION = 1
MAX_HEADER_BYTES = 1 << 20


class ChunkFileError(Exception):
    """A chunk file is damaged, truncated or belongs to another model/layout."""


class ChunkUnavailable(ChunkFileError):
    """A chunk could not be read at all (missing, tier disabled, store unreachable):
    a failed load, but not a damaged chunk."""


@dataclass(frozen=True)
class ChunkHeader:
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
        return json.dumps({
            "identity": self.identity,
            "block_hashes": [h.hex() for h in self.block_hashes],
            "shape": list(self.shape),
            "payload_crc": self.payload_crc,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "ChunkHeader":
        try:
            d = json.loads(raw)
            return cls(str(d["identity"]), tuple(bytes.fromhex(h) for h in d["block_hashes"]),
                       tuple(int(x) for x in d["shape"]), int(d["payload_crc"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ChunkFileError(f"unreadable header: {e}") from None


def encode_chunk_file(identity: str, block_hashes: list[bytes], payload: torch.Tensor) -> list[bytes | memoryview]:
    """The pieces of a chunk file, ready for ``writelines`` (payload not copied)."""
    data = memoryview(payload.contiguous().numpy()).cast("B")
    header = ChunkHeader(identity, tuple(block_hashes), tuple(payload.shape), zlib.crc32(data)).to_bytes()
    return [framed_header(MAGIC, VERSION, header), data]


def read_header(f, identity: str | None) -> ChunkHeader:
    raw = read_framed_header(f.read, MAGIC, VERSION, MAX_HEADER_BYTES, ChunkFileError, "chunk file")
    header = ChunkHeader.from_bytes(raw)
    if identity is not None and header.identity != identity:
        raise ChunkFileError(f"chunk belongs to another model/layout ({header.identity}, expected {identity})")
    return header


def read_chunk(f, identity: str) -> tuple[ChunkHeader, torch.Tensor]:
    """Read and verify a whole chunk from a binary stream; ChunkFileError on any damage."""
    header = read_header(f, identity)
    payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
    view = memoryview(payload.numpy())
    got = f.readinto(view)
    if got != header.payload_bytes or f.read(1):
        raise ChunkFileError(f"payload is {got}+ bytes, header says {header.payload_bytes}")
    if zlib.crc32(view) != header.payload_crc:
        raise ChunkFileError("payload checksum mismatch")
    return header, payload.view(header.shape)


def read_chunk_file(path: Path, identity: str) -> tuple[ChunkHeader, torch.Tensor]:
    with open(path, "rb") as f:
        return read_chunk(f, identity)


class DiskTier:
    """Files for one (model identity, rank). Writes run on a background thread
    in submission order, so a delete queued after a write always wins."""

    def __init__(self, root: str | Path, identity: str, rank: int, queue_size: int,
                 on_error: Callable[[str], None] | None = None):
        self.dir = Path(root) / identity / f"rank{rank}"
        self.identity = identity
        self.enabled = True
        self._on_error = on_error or (lambda msg: None)
        self._pending: dict[bytes, torch.Tensor] = {}   # written soon; readable meanwhile
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.failed_keys: list[bytes] = []               # writes that did not land
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".kvreel-write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            self._disable(f"disk tier directory {self.dir} is not writable ({e})")
        self._thread = threading.Thread(target=self._run, name="kvreel-disk-writer", daemon=True)
        self._thread.start()

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kvr"

    # -- writes (background) ---------------------------------------------------
    def submit_write(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        """Queue a write; False (and the key reported as failed) if the queue is full."""
        if not self.enabled:
            self.failed_keys.append(key)
            return False
        with self._lock:
            self._pending[key] = payload
        try:
            self._queue.put_nowait(("write", key, block_hashes, payload))
            return True
        except queue.Full:
            with self._lock:
                self._pending.pop(key, None)
            self.failed_keys.append(key)
            return False

    def submit_delete(self, key: bytes) -> None:
        self._queue.put(("delete", key, None, None))

    def flush(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            op, key, hashes, payload = self._queue.get()
            try:
                if op == "stop":
                    return
                if op == "write":
                    self._write(key, hashes, payload)
                else:
                    self._delete(key)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, hashes: list[bytes], payload: torch.Tensor) -> None:
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.tmp")
        try:
            if not self.enabled:
                raise OSError(errno.EIO, "disk tier disabled")
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.writelines(encode_chunk_file(self.identity, hashes, payload))
            os.replace(tmp, path)   # readers never see a half-written chunk
        except OSError as e:
            self.failed_keys.append(key)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO):
                self._disable(f"disk tier write failed ({e}); disk tier disabled, serving continues "
                              "from the other tiers")
            else:
                logger.warning("kvreel: disk write of chunk %s failed: %s", key.hex()[:16], e)
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _delete(self, key: bytes) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as e:
            logger.warning("kvreel: could not delete %s: %s", self.path(key), e)

    def _disable(self, msg: str) -> None:
        if self.enabled:
            self.enabled = False
            logger.error("kvreel: %s", msg)
            self._on_error(msg)

    # -- reads -----------------------------------------------------------------
    def read(self, key: bytes) -> torch.Tensor:
        """The payload [regions, blocks, block_bytes] of a chunk, verified."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending
        try:
            _, payload = read_chunk_file(self.path(key), self.identity)
        except FileNotFoundError:
            raise ChunkUnavailable("chunk file is missing") from None
        except OSError as e:
            raise ChunkUnavailable(f"cannot read chunk file: {e}") from None
        return payload

    def close(self) -> None:
        self._queue.put(("stop", None, None, None))
        self._thread.join(timeout=60)


def scan_chunk_headers(root: str | Path, identity: str, rank: int = 0) -> Iterator[tuple[bytes, ChunkHeader | ChunkFileError]]:
    """Headers of every chunk file a previous engine left (rank 0's view);
    a damaged file yields its ChunkFileError instead."""
    d = Path(root) / identity / f"rank{rank}"
    if not d.is_dir():
        return
    for path in sorted(d.glob("*/*.kvr")):
        try:
            key = bytes.fromhex(path.stem)
        except ValueError:
            continue   # not a name kvreel writes
        try:
            with open(path, "rb") as f:
                header = read_header(f, identity)
                header_end = f.tell()
            if os.path.getsize(path) != header_end + header.payload_bytes:
                raise ChunkFileError("truncated payload")
            yield key, header
        except (ChunkFileError, OSError) as e:
            yield key, ChunkFileError(f"{path}: {e}")
