"""The remote tier: chunks in a shared store (Redis or a shared filesystem) that
any engine of the same model can reuse.

Every stored chunk is written as the same self-checking file format as the disk
tier (identity, block hashes, CRC-32s), under ``kvreel/<identity>/c/<chunk>``,
plus one 36-byte pointer per block under ``kvreel/<identity>/b/<block hash>``
(chunk key + row), so a prefix lookup is one MGET however the chunks were cut.

Scheduler side: ``RemoteLookups`` runs lookups on a thread so the scheduler
never waits on the network (vLLM is told "ask again next step" meanwhile).
Worker side: ``RemoteTier`` uploads write-behind (bounded queue, never blocking
the forward pass, drained on clean shutdown) and fetches chunks for async loads.
"""

from __future__ import annotations

import io
import logging
import queue
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvreel.connector.disk_tier import ChunkFileError, ChunkUnavailable, encode_chunk_file, read_chunk
from kvreel.connector.remote_store import RemoteError, block_key, chunk_key, open_store

logger = logging.getLogger("kvreel.remote")
_POINTER = struct.Struct("<32sI")


class _Throttled:
    """Log a recurring failure at most once per ``every`` seconds."""

    def __init__(self, every: float = 30.0):
        self.every, self.last = every, 0.0

    def warn(self, msg, *args):
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            logger.warning(msg, *args)


class RemoteLookups:
    """Scheduler side: which leading blocks of a request the store holds."""

    def __init__(self, url: str, identity: str, timeout_s: float):
        self.identity = identity
        self.store = open_store(url, timeout_s=timeout_s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvreel-remote-lookup")
        self._pending: dict[str, Future] = {}
        self._log = _Throttled()
        self.errors = 0

    def poll(self, req_id: str, hashes: list[bytes]) -> list[tuple[bytes, int]] | None:
        """Pointers (chunk key, row) of the longest run of ``hashes`` held remotely,
        or None while the lookup is in flight. A failed lookup is an empty run."""
        fut = self._pending.get(req_id)
        if fut is None:
            self._pending[req_id] = self._pool.submit(self._lookup, list(hashes))
            return None
        if not fut.done():
            return None
        del self._pending[req_id]
        try:
            return fut.result()
        except (RemoteError, ValueError) as e:
            self.errors += 1
            self._log.warn("kvreel: remote lookup failed (%s); serving from local tiers / recompute", e)
            return []

    def _lookup(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        if not hashes:
            return []
        values = self.store.get_many([block_key(self.identity, h) for h in hashes])
        out = []
        for v in values:
            if v is None or len(v) != _POINTER.size:
                break
            out.append(_POINTER.unpack(v))
        # pointers can outlive their chunk (store eviction, a deleted damaged chunk):
        # the run ends at the first block whose chunk is gone
        chunks = list(dict.fromkeys(k for k, _ in out))
        present = dict(zip(chunks, self.store.exists([chunk_key(self.identity, k) for k in chunks])))
        for i, (k, _) in enumerate(out):
            if not present[k]:
                return out[:i]
        return out

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


class RemoteTier:
    """Worker side: write-behind uploads and verified fetches."""

    def __init__(self, url: str, identity: str, timeout_s: float, queue_size: int):
        self.identity = identity
        self.store = open_store(url, timeout_s=timeout_s)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._log = _Throttled()
        self.failed_uploads = 0
        self.dropped_uploads = 0
        self._thread = threading.Thread(target=self._run, name="kvreel-remote-upload", daemon=True)
        self._thread.start()

    def submit_upload(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        try:
            self._queue.put_nowait((key, block_hashes, payload))
            return True
        except queue.Full:
            self.dropped_uploads += 1
            self._log.warn("kvreel: remote upload queue full; chunk %s not uploaded", key.hex()[:16])
            return False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, hashes, payload = item
                data = b"".join(bytes(p) for p in encode_chunk_file(self.identity, hashes, payload))
                self.store.put(chunk_key(self.identity, key), data)
                # pointers after the chunk: a reader never sees a pointer to a missing chunk
                self.store.put_many({block_key(self.identity, h): _POINTER.pack(key, row)
                                     for row, h in enumerate(hashes)})
            except (RemoteError, ValueError) as e:
                self.failed_uploads += 1
                self._log.warn("kvreel: remote upload failed (%s)", e)
            finally:
                self._queue.task_done()

    def fetch(self, key: bytes) -> torch.Tensor:
        """The verified payload [regions, blocks, block_bytes] of a remote chunk."""
        try:
            data = self.store.get(chunk_key(self.identity, key))
        except RemoteError as e:
            raise ChunkUnavailable(f"remote store: {e}") from None
        if data is None:
            raise ChunkUnavailable("chunk is missing from the remote store")
        try:
            return read_chunk(io.BytesIO(data), self.identity)[1]
        except ChunkFileError:
            try:   # a damaged chunk is removed so that lookups stop offering it
                self.store.delete(chunk_key(self.identity, key))
            except RemoteError:
                pass
            raise

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Drain pending uploads (bounded), then stop."""
        deadline = time.monotonic() + drain_timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1)
        self.store.close()
