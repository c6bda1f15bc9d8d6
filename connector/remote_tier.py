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
import json
import logging
import queue
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import zstandard

from kvreel.codec import ChunkError, decode_chunk, encode_chunk, read_header
from kvreel.connector.disk_tier import ChunkFileError, ChunkUnavailable, encode_chunk_file, read_chunk
from kvreel.connector.remote_store import RemoteError, block_key, chunk_key, delete_quietly, open_store

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


def form_key(identity: str, form: str, key: bytes, quant: str = "none") -> str:
    """Store key of one stored form of a chunk (the raw form is ``chunk_key``).
    A quantized video form has its own key: an exact reader never finds it."""
    if form == "raw":
        return chunk_key(identity, key)
    suffix = f"-{quant}" if form.startswith("video") and quant != "none" else ""
    return f"kvreel/{identity}/{form.replace('@', '')}{suffix}/{key.hex()}"


def manifest_key(identity: str, key: bytes) -> str:
    return f"kvreel/{identity}/m/{key.hex()}"


class RemoteTier:
    """Worker side: write-behind uploads of every configured form, verified fetches.

    Each chunk is stored as the raw chunk file (exact; the fallback every fetch
    can use), optionally zstd of that file and lossless-video containers at each
    resolution (``video@256``...), plus a small JSON manifest of the stored
    forms and their sizes that the fetch controller chooses from."""

    def __init__(self, url: str, identity: str, timeout_s: float, queue_size: int, *,
                 forms: tuple[str, ...] = ("raw",), quant: str = "none", resolutions: tuple[int, ...] = (256,),
                 kv_view=None):
        self.identity = identity
        self.store = open_store(url, timeout_s=timeout_s)
        self.forms, self.quant, self.resolutions, self.kv_view = forms, quant, resolutions, kv_view
        self.decode_device = torch.device("cpu")     # the engine's GPU: NVDEC decodes the video form
        if "video" in forms and kv_view is None:
            raise ValueError("the video form needs the engine's page geometry")
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._log = _Throttled()
        self.failed_uploads = 0
        self.dropped_uploads = 0
        self._reported_failures = 0
        self._encode_seconds: dict[str, float] = {}
        self._encode_lock = threading.Lock()        # the uploader adds, the metrics take
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

    def encode_forms(self, block_hashes: list[bytes], payload: torch.Tensor,
                     seconds: dict[str, float] | None = None) -> dict[str, bytes]:
        """Every configured form of one chunk: form name -> stored bytes (and the
        time each form took added to ``seconds``)."""
        def took(form: str, t0: float) -> None:
            if seconds is not None:
                seconds[form] = seconds.get(form, 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        raw = b"".join(bytes(p) for p in encode_chunk_file(self.identity, block_hashes, payload))
        out = {"raw": raw}
        took("raw", t0)
        if "zstd" in self.forms:
            t0 = time.perf_counter()
            out["zstd"] = zstandard.ZstdCompressor(level=3).compress(raw)
            took("zstd", t0)
        if "video" in self.forms:
            kv = self.kv_view.to_kv(payload)
            for r in self.resolutions:
                t0 = time.perf_counter()
                out[f"video@{r}"] = encode_chunk(kv, quant=self.quant, resolutions=(r,), model=self.identity)
                took(f"video@{r}", t0)
        return out

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, hashes, payload = item
                spent: dict[str, float] = {}
                forms = self.encode_forms(hashes, payload, spent)
                with self._encode_lock:
                    for form, dt in spent.items():
                        self._encode_seconds[form] = self._encode_seconds.get(form, 0.0) + dt
                self.store.put_many({form_key(self.identity, f, key, self.quant): v for f, v in forms.items()})
                manifest = {"forms": {f: len(v) for f, v in forms.items()}, "quant": self.quant,
                            "payload": list(payload.shape)}
                self.store.put(manifest_key(self.identity, key), json.dumps(manifest).encode())
                # pointers after the chunk: a reader never sees a pointer to a missing chunk
                self.store.put_many({block_key(self.identity, h): _POINTER.pack(key, row)
                                     for row, h in enumerate(hashes)})
            except (RemoteError, ValueError) as e:
                self.failed_uploads += 1
                self._log.warn("kvreel: remote upload failed (%s)", e)
            finally:
                self._queue.task_done()

    def manifests(self, keys: list[bytes]) -> list[dict[str, int]]:
        """Stored forms and sizes of each chunk (one round trip); a chunk whose
        manifest is missing or unreadable offers only its raw form."""
        try:
            values = self.store.get_many([manifest_key(self.identity, k) for k in keys])
        except RemoteError:
            values = [None] * len(keys)
        out = []
        for v in values:
            forms = {}
            try:
                forms = {str(f): int(n) for f, n in json.loads(v)["forms"].items()} if v else {}
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
            forms.setdefault("raw", 0)
            out.append(forms)
        return out

    def get_form(self, key: bytes, form: str) -> bytes:
        try:
            data = self.store.get(form_key(self.identity, form, key, self.quant))
        except RemoteError as e:
            raise ChunkUnavailable(f"remote store: {e}") from None
        if data is None:
            raise ChunkUnavailable(f"the {form} form is missing from the remote store")
        return data

    def decode_form(self, form: str, data: bytes, payload_shape: tuple[int, ...] | None = None,
                    on_regions: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """The verified payload [regions, blocks, block_bytes] from one stored form
        (on ``decode_device`` for the video form, on the CPU otherwise).

        ``on_regions(first, rows)`` receives verified payload rows as soon
        as they are decoded: the video form hands on each layer triplet while
        later frames are still decoding, the byte forms the whole chunk at once."""
        if form == "zstd":
            try:
                data = zstandard.ZstdDecompressor().decompress(data, max_output_size=self.store.max_value_bytes)
            except zstandard.ZstdError as e:
                raise ChunkFileError(f"zstd form: {e}") from None
        if form in ("raw", "zstd"):
            payload = read_chunk(io.BytesIO(data), self.identity)[1]
            if on_regions is not None:
                on_regions(0, payload)
            return payload
        try:
            header = read_header(data)
            if header.model != self.identity:
                raise ChunkFileError("video form belongs to another model/layout")
            if header.quant != self.quant:
                raise ChunkFileError(f"video form is quantized {header.quant!r}, this engine wants {self.quant!r}")
            hand_on = None if on_regions is None else (
                lambda first, layers: on_regions(first, self.kv_view.to_payload(layers)))
            kv = decode_chunk(data, device=self.decode_device, on_layers=hand_on)
        except ChunkError as e:
            raise ChunkFileError(f"{form} form: {e}") from None
        payload = self.kv_view.to_payload(kv)
        if payload_shape is not None and tuple(payload.shape) != tuple(payload_shape):
            raise ChunkFileError(f"{form} form decodes to {tuple(payload.shape)}, expected {tuple(payload_shape)}")
        return payload

    def fetch(self, key: bytes, form: str = "raw") -> torch.Tensor:
        """The verified payload of a remote chunk in one form (damaged forms are deleted)."""
        data = self.get_form(key, form)
        try:
            return self.decode_form(form, data)
        except ChunkFileError:
            self.drop_form(key, form)
            raise

    def drop_form(self, key: bytes, form: str) -> None:
        """Remove a damaged form so that lookups/fetches stop offering it."""
        delete_quietly(self.store, form_key(self.identity, form, key, self.quant))

    def take_encode_seconds(self) -> dict[str, float]:
        """Encode time per form since the last call (for the metrics)."""
        with self._encode_lock:
            taken, self._encode_seconds = self._encode_seconds, {}
        return taken

    def take_upload_failures(self) -> int:
        """Uploads failed or dropped since the last call (for the metrics)."""
        total = self.failed_uploads + self.dropped_uploads
        n, self._reported_failures = total - self._reported_failures, total
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
