"""Remote tier: chunks in a store shared by engines (Redis or a directory).

Every chunk is stored in each configured form (``kvreel.codec.forms``: the raw
chunk file, zstd of it, lossless video per resolution), plus a JSON manifest
of the forms and their sizes and one 36-byte pointer per block (chunk key +
row), so a prefix lookup is one MGET however the chunks were cut. Keys come
from ``kvreel.codec.formats.StoreKeys``.

This is the worker half; the scheduler half,
``kvreel.scheduler.remote_lookups``, finds which leading blocks of a request the
store holds. ``RemoteTier`` uploads write-behind (bounded queues, never blocking
the forward pass; the byte forms and pointers first, the video forms after;
drained on clean shutdown) and hands stored bytes to the fetch controller
(``kvreel.connector.worker_side.fetch.controller``), which decodes them.
"""

from __future__ import annotations

import json
import logging
import queue
import threading

import torch

from kvreel.codec.formats import BLOCK_POINTER, RAW, VIDEO_FORM, ChunkUnavailable, StoreKeys, form_kind
from kvreel.codec.forms import StoredForms
from kvreel.connector.tiers import ChunkTier, Tier, wait_for_queues, yield_to_the_engine
from kvreel.connector.tiers.store import RemoteError, ThrottledWarning, delete_quietly, open_store

logger = logging.getLogger(__name__)


class RemoteTier(ChunkTier):
    """Worker side: write-behind uploads of every configured form; stored bytes
    for the fetch controller; ``get`` for a plain verified raw fetch.

    Uploads run in two stages, each on its own thread and bounded queue: the
    byte forms (raw, zstd: a copy and a fast compression) with the manifest and
    the block pointers first, so a chunk is fetchable as soon as it is stored;
    then the video forms (libx265 takes about a second per chunk on a CPU), each
    added to the manifest once it is stored. Slow video encoding never delays a
    chunk's availability, and a shutdown that cannot wait for it loses only the
    video forms."""

    kind = Tier.REMOTE

    def __init__(self, url: str, forms: StoredForms, timeout_s: float, queue_size: int):
        self.forms = forms
        self.keys = StoreKeys(forms.identity)
        self.store = open_store(url, timeout_s=timeout_s)
        forms.max_bytes = self.store.max_value_bytes
        names = forms.names()
        self._byte_forms = [n for n in names if form_kind(n) != VIDEO_FORM]
        self._video_forms = [n for n in names if form_kind(n) == VIDEO_FORM]
        self._log = ThrottledWarning(logger)
        self._lock = threading.Lock()                # the uploaders add, the metrics take
        self._failed_keys: set[bytes] = set()
        self._encode_seconds: dict[str, float] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._video_queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._threads = [threading.Thread(target=self._run, args=(q, fn), name=name, daemon=True)
                         for q, fn, name in ((self._queue, self._upload, "kvreel-remote-upload"),
                                             (self._video_queue, self._upload_video, "kvreel-remote-video"))]
        for t in self._threads:
            t.start()

    def put(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        try:
            self._queue.put_nowait((key, block_hashes, payload))
            return True
        except queue.Full:
            self._failed(key, "kvreel: remote upload queue full; chunk %s not uploaded", key.hex()[:16])
            return False

    def _failed(self, key: bytes, msg, *args) -> None:
        with self._lock:
            self._failed_keys.add(key)
        self._log.warn(msg, *args)

    def _run(self, jobs: queue.Queue, upload) -> None:
        yield_to_the_engine()
        while True:
            item = jobs.get()
            try:
                if item is None:
                    return
                upload(*item)
            except (RemoteError, ValueError) as e:
                self._failed(item[0], "kvreel: remote upload failed (%s)", e)
            finally:
                jobs.task_done()

    def _encode(self, hashes: list[bytes], payload: torch.Tensor, names: list[str]):
        for name, data, dt in self.forms.encode_each(hashes, payload, names):
            with self._lock:
                self._encode_seconds[name] = self._encode_seconds.get(name, 0.0) + dt
            yield name, data

    def _put_manifest(self, key: bytes, sizes: dict[str, int], payload: torch.Tensor) -> None:
        manifest = {"forms": sizes, "quant": self.forms.quant, "payload": list(payload.shape)}
        self.store.put(self.keys.manifest(key), json.dumps(manifest).encode())

    def _upload(self, key: bytes, hashes: list[bytes], payload: torch.Tensor) -> None:
        stored = dict(self._encode(hashes, payload, self._byte_forms))
        quant = self.forms.quant
        self.store.put_many({self.keys.form(f, key, quant): v for f, v in stored.items()})
        sizes = {f: len(v) for f, v in stored.items()}
        self._put_manifest(key, sizes, payload)
        # pointers after the chunk: a reader never sees a pointer to a missing chunk
        self.store.put_many({self.keys.block(h): BLOCK_POINTER.pack(key, row) for row, h in enumerate(hashes)})
        if self._video_forms:
            try:
                self._video_queue.put_nowait((key, hashes, payload, sizes))
            except queue.Full:
                self._failed(key, "kvreel: video encoding queue full; chunk %s stored without its video forms",
                             key.hex()[:16])

    def _upload_video(self, key: bytes, hashes: list[bytes], payload: torch.Tensor, sizes: dict[str, int]) -> None:
        for name, data in self._encode(hashes, payload, self._video_forms):
            self.store.put(self.keys.form(name, key, self.forms.quant), data)
            sizes[name] = len(data)
            self._put_manifest(key, sizes, payload)      # offered once stored

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued upload, video forms included, is done."""
        return wait_for_queues([self._queue, self._video_queue], timeout_s)

    def manifests(self, keys: list[bytes]) -> list[dict[str, int]]:
        """Stored forms and sizes of each chunk (one round trip); a chunk whose
        manifest is missing or unreadable offers only its raw form."""
        try:
            values = self.store.get_many([self.keys.manifest(k) for k in keys])
        except RemoteError as e:
            self._log.warn("kvreel: remote manifests unreadable (%s); fetching %d chunk(s) raw", e, len(keys))
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
        """The verified payload of a remote chunk in one form (a damaged form, or
        one that holds other blocks than ``key`` names, is deleted)."""
        data = self.get_form(key, form)
        try:
            return self.forms.decode(form, data, key=key)
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
        with self._lock:
            taken, self._encode_seconds = self._encode_seconds, {}
        return taken

    def take_failed_writes(self) -> set[bytes]:
        """Chunks whose upload failed or was dropped (a full queue), the video
        forms' included, since the last call."""
        with self._lock:
            taken, self._failed_keys = self._failed_keys, set()
        return taken

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Drain pending uploads (bounded; vLLM may end the process sooner), then stop."""
        pending = self._queue.unfinished_tasks, self._video_queue.unfinished_tasks
        if any(pending):
            logger.info("kvreel: storing %d queued chunk(s) and the video forms of %d before shutdown",
                        *pending)
        if not self.flush(drain_timeout_s):
            logger.warning("kvreel: shutdown left %d chunk upload(s) and %d video encoding(s) unfinished; "
                           "those chunks are recomputed (or fetched in a byte form) later",
                           self._queue.unfinished_tasks, self._video_queue.unfinished_tasks)
        for jobs, thread in zip((self._queue, self._video_queue), self._threads):
            try:
                jobs.put_nowait(None)
            except queue.Full:
                continue
            thread.join(timeout=1)
        self.store.close()
