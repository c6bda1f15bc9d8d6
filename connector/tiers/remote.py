"""Remote tier: chunks in a store shared by engines (Redis or a directory).

Every chunk is stored in each configured form (``kvreel.codec.forms``: the raw
chunk file, zstd of it, lossless video per resolution), plus a JSON manifest
of the forms and their sizes and one 36-byte pointer per block (chunk key +
row), so a prefix lookup is one MGET however the chunks were cut. Keys come
from ``kvreel.codec.formats.StoreKeys``.

Scheduler side: ``RemoteLookups`` runs lookups on a thread so the scheduler
never waits on the network (vLLM is told "ask again next step" meanwhile).
Worker side: ``RemoteTier`` uploads write-behind (bounded queue, never blocking
the forward pass, drained on clean shutdown) and hands stored bytes to the
fetch controller (``kvreel.scheduler.fetch_controller``), which decodes them.
"""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvreel.codec.formats import RAW, ChunkUnavailable, StoreKeys
from kvreel.codec.forms import StoredForms
from kvreel.connector.tiers import Tier
from kvreel.connector.tiers.store import RemoteError, delete_quietly, open_store

logger = logging.getLogger(__name__)
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
        self.keys = StoreKeys(identity)
        self.store = open_store(url, timeout_s=timeout_s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvreel-remote-lookup")
        self._pending: dict[str, tuple[tuple[bytes, ...], Future]] = {}
        self._log = _Throttled()
        self.errors = 0

    def poll(self, req_id: str, hashes: list[bytes]) -> list[tuple[bytes, int]] | None:
        """Pointers (chunk key, row) of the longest run of ``hashes`` held remotely,
        or None while the lookup is in flight. A failed lookup is an empty run.

        The answer always belongs to exactly these ``hashes``: when the request
        asks about other blocks than the lookup in flight (its local hit grew,
        it was preempted and resumed), the stale lookup is dropped and a new one
        starts, so pointers can never be applied to the wrong blocks."""
        wanted = tuple(hashes)
        pending = self._pending.get(req_id)
        if pending is None or pending[0] != wanted:
            self._pending[req_id] = (wanted, self._pool.submit(self._lookup, list(wanted)))
            return None
        fut = pending[1]
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
        values = self.store.get_many([self.keys.block(h) for h in hashes])
        out = []
        for v in values:
            if v is None or len(v) != _POINTER.size:
                break
            out.append(_POINTER.unpack(v))
        # pointers can outlive their chunk (store eviction, a deleted damaged chunk):
        # the run ends at the first block whose chunk is gone
        chunks = list(dict.fromkeys(k for k, _ in out))
        present = dict(zip(chunks, self.store.exists([self.keys.chunk(k) for k in chunks])))
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
    """Worker side: write-behind uploads of every configured form; stored bytes
    for the fetch controller; ``get`` for a plain verified raw fetch."""

    kind = Tier.REMOTE

    def __init__(self, url: str, forms: StoredForms, timeout_s: float, queue_size: int):
        self.forms = forms
        self.keys = StoreKeys(forms.identity)
        self.store = open_store(url, timeout_s=timeout_s)
        forms.max_bytes = self.store.max_value_bytes
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._log = _Throttled()
        self._lock = threading.Lock()                # the uploader adds, the metrics take
        self._upload_failures = 0
        self._encode_seconds: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="kvreel-remote-upload", daemon=True)
        self._thread.start()

    def put(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        try:
            self._queue.put_nowait((key, block_hashes, payload))
            return True
        except queue.Full:
            with self._lock:
                self._upload_failures += 1
            self._log.warn("kvreel: remote upload queue full; chunk %s not uploaded", key.hex()[:16])
            return False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._upload(*item)
            except (RemoteError, ValueError) as e:
                with self._lock:
                    self._upload_failures += 1
                self._log.warn("kvreel: remote upload failed (%s)", e)
            finally:
                self._queue.task_done()

    def _upload(self, key: bytes, hashes: list[bytes], payload: torch.Tensor) -> None:
        spent: dict[str, float] = {}
        stored = self.forms.encode(hashes, payload, spent)
        with self._lock:
            for form, dt in spent.items():
                self._encode_seconds[form] = self._encode_seconds.get(form, 0.0) + dt
        quant = self.forms.quant
        self.store.put_many({self.keys.form(f, key, quant): v for f, v in stored.items()})
        manifest = {"forms": {f: len(v) for f, v in stored.items()}, "quant": quant, "payload": list(payload.shape)}
        self.store.put(self.keys.manifest(key), json.dumps(manifest).encode())
        # pointers after the chunk: a reader never sees a pointer to a missing chunk
        self.store.put_many({self.keys.block(h): _POINTER.pack(key, row) for row, h in enumerate(hashes)})

    def manifests(self, keys: list[bytes]) -> list[dict[str, int]]:
        """Stored forms and sizes of each chunk (one round trip); a chunk whose
        manifest is missing or unreadable offers only its raw form."""
        try:
            values = self.store.get_many([self.keys.manifest(k) for k in keys])
        except RemoteError:
            values = [None] * len(keys)
        out = []
        for v in values:
            forms = {}
            try:
                forms = {str(f): int(n) for f, n in json.loads(v)["forms"].items()} if v else {}
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
            forms.setdefault(RAW, 0)
            out.append(forms)
        return out

    def get_form(self, key: bytes, form: str) -> bytes:
        """The stored bytes of one form of a chunk (unverified: the caller decodes)."""
        try:
            data = self.store.get(self.keys.form(form, key, self.forms.quant))
        except RemoteError as e:
            raise ChunkUnavailable(f"remote store: {e}") from None
        if data is None:
            raise ChunkUnavailable(f"the {form} form is missing from the remote store")
        return data

    def get(self, key: bytes, form: str = RAW) -> torch.Tensor:
        """The verified payload of a remote chunk in one form (a damaged form is deleted)."""
        data = self.get_form(key, form)
        try:
            return self.forms.decode(form, data)
        except ChunkUnavailable:
            raise
        except ValueError:
            self.drop_form(key, form)
            raise

    def drop_form(self, key: bytes, form: str) -> None:
        """Remove a damaged form so that lookups/fetches stop offering it."""
        delete_quietly(self.store, self.keys.form(form, key, self.forms.quant))

    def delete(self, key: bytes) -> None:
        for form in self.forms.names():
            self.drop_form(key, form)

    def take_encode_seconds(self) -> dict[str, float]:
        """Encode time per form since the last call (for the metrics)."""
        with self._lock:
            taken, self._encode_seconds = self._encode_seconds, {}
        return taken

    def take_upload_failures(self) -> int:
        """Uploads failed or dropped since the last call (for the metrics)."""
        with self._lock:
            n, self._upload_failures = self._upload_failures, 0
        return n

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
