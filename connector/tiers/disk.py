"""Disk tier: one self-checking chunk file per chunk (``kvreel.codec.formats``:
identity, block hashes, CRC-32s), so a corrupted, truncated or foreign file is
recognised before a single byte reaches the KV cache, and chunks survive an
engine restart."""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Iterator

import torch

from kvreel.codec.formats import (ChunkError, ChunkFileHeader, ChunkUnavailable, chunk_dir, chunk_path,
                                  encode_chunk_file, identity_description_path, key_of_path, read_chunk,
                                  read_chunk_header)
from kvreel.connector.tiers import ChunkTier, Tier, TierChanges, wait_for_queues, yield_to_the_engine

logger = logging.getLogger(__name__)

# errors that mean the directory cannot take writes any more (not one bad file)
_TIER_BROKEN = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
# a disabled tier probes its directory again after 1 s, then 2, 4, 8 (at most)
PROBE_FIRST_S, PROBE_MAX_S = 1.0, 8.0


class DiskTier(ChunkTier):
    """Files for one (model identity, rank). Writes run on a background thread
    in submission order, so a delete queued after a write always wins; a write
    that did not land is reported through ``take_failed_writes``.

    A full, read-only or vanished directory turns the tier off (``take_changes``
    says so once); the writer thread then probes it with backoff and turns it
    back on once it takes a chunk's worth of bytes again."""

    kind = Tier.DISK

    def __init__(self, root: str | Path, identity: str, rank: int, queue_size: int,
                 description: dict | None = None):
        self.root, self.identity, self.rank = root, identity, rank
        self.dir = chunk_dir(root, identity, rank)
        self.enabled = True
        self._description = description
        self._pending: dict[bytes, torch.Tensor] = {}   # written soon; readable meanwhile
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._failed: set[bytes] = set()                 # writes that did not land, until taken
        self._went_off: str | None = None                # why the tier turned off, until taken
        self._came_back = False                          # it turned on again, until taken
        self._probe_in = PROBE_FIRST_S
        self._needed = 0                                 # bytes of the write that failed
        try:
            self._probe()
        except OSError as e:
            self._disable(f"disk tier directory {self.dir} is not writable ({e})")
        self._thread = threading.Thread(target=self._run, name="kvreel-disk-writer", daemon=True)
        self._thread.start()

    def path(self, key: bytes) -> Path:
        return chunk_path(self.root, self.identity, self.rank, key)

    # -- writes (background) ---------------------------------------------------
    def put(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        """Queue a write; False (and the key reported as failed) if the tier is
        disabled or its queue is full."""
        if not self.enabled:
            self._fail(key)
            return False
        with self._lock:
            self._pending[key] = payload
        try:
            self._queue.put_nowait(("write", key, block_hashes, payload))
            return True
        except queue.Full:
            with self._lock:
                self._pending.pop(key, None)
            self._fail(key)
            return False

    def delete(self, key: bytes) -> None:
        self._queue.put(("delete", key, None, None))

    def take_failed_writes(self) -> set[bytes]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def take_changes(self) -> TierChanges:
        with self._lock:
            changes = TierChanges(self._went_off, self._came_back)
            self._went_off, self._came_back = None, False
        return changes

    def _fail(self, key: bytes) -> None:
        with self._lock:
            self._failed.add(key)

    def flush(self, timeout_s: float | None = None) -> bool:
        return wait_for_queues([self._queue], timeout_s)

    def _probe(self) -> None:
        """Raise OSError unless the directory takes a write and has room for the
        write that failed (statvfs: a probe file that size would cost a disk
        write per probe)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".kvreel-write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
        free = shutil.disk_usage(self.dir).free
        if free < 2 * self._needed:
            raise OSError(errno.ENOSPC, f"{free} bytes free, a chunk needs {self._needed}")
        if self._description is not None:
            write_description(self.root, self.identity, self._description)

    def _probe_again(self) -> None:
        try:
            self._probe()
        except OSError:
            self._probe_in = min(PROBE_MAX_S, self._probe_in * 2)
            return
        logger.warning("kvreel: disk tier %s takes writes again; disk tier back on", self.dir)
        with self._lock:
            self.enabled, self._came_back = True, True

    def _run(self) -> None:
        yield_to_the_engine()
        while True:
            try:
                op, key, hashes, payload = self._queue.get(timeout=None if self.enabled else self._probe_in)
            except queue.Empty:
                self._probe_again()
                continue
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
            self._probe_in = PROBE_FIRST_S
        except OSError as e:
            self._fail(key)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if e.errno in _TIER_BROKEN:
                self._needed = payload.numel() * payload.element_size()
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
        with self._lock:
            if not self.enabled:
                return
            self.enabled, self._went_off = False, msg
        logger.error("kvreel: %s", msg)

    # -- reads -----------------------------------------------------------------
    def get(self, key: bytes) -> torch.Tensor:
        """The payload [regions, blocks, block_bytes] of a chunk, verified."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending
        try:
            with open(self.path(key), "rb") as f:
                return read_chunk(f, self.identity)[1]
        except FileNotFoundError:
            raise ChunkUnavailable("chunk file is missing") from None
        except OSError as e:
            raise ChunkUnavailable(f"cannot read chunk file: {e}") from None

    def close(self) -> None:
        self._queue.put(("stop", None, None, None))
        self._thread.join(timeout=60)


def write_description(root: str | Path, identity: str, description: dict) -> None:
    """``<root>/<identity>/identity.json``: what the identity digest stands for,
    so a person (``kvreel inspect``) can tell which model a directory holds."""
    path = identity_description_path(root, identity)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(description, indent=1, sort_keys=True))
    os.replace(tmp, path)


def scan_chunk_files(root: str | Path, identity: str,
                     rank: int = 0) -> Iterator[tuple[bytes, Path, ChunkFileHeader | ChunkError]]:
    """(key, path, header) of every chunk file a previous engine left (rank 0's
    view); a damaged file yields its ChunkError in place of the header."""
    d = chunk_dir(root, identity, rank)
    if not d.is_dir():
        return
    for path in sorted(d.glob("*/*.kvr")):
        key = key_of_path(path)
        if key is None:
            continue
        try:
            with open(path, "rb") as f:
                header = read_chunk_header(f, identity)
                header_end = f.tell()
            if os.path.getsize(path) != header_end + header.payload_bytes:
                raise ChunkError("truncated payload")
            yield key, path, header
        except (ChunkError, OSError) as e:
            yield key, path, ChunkError(f"{path}: {e}")
