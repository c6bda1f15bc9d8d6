"""kvreel's remote store (Redis or a shared filesystem) as an LMCache L2 adapter.

For LMCache's multiprocess mode::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvreel.connector.lmcache.l2_adapter", "class_name": "KVReelL2Adapter",
        "adapter_params": {"url": "redis://127.0.0.1:6379/0"},
        "serde": {"type": "kvreel", "form": "video"}}'

``adapter_params``: ``url`` (redis://, rediss:// or file://; required),
``timeout_s`` (per store operation, default 2), ``max_object_bytes`` (default
256 MiB), ``workers`` (I/O threads, default 2). Every object is stored in
kvreel's self-checking form (key, shapes, CRC-32s; see ``kv_object``): objects
the ``kvreel`` serde produced are stored at their real (compressed) size,
others as raw checked sections. A damaged, truncated or foreign object loads
as a miss (its bit stays 0), is logged, and is deleted from the store.
Redis and files cannot pin objects, so lookup-and-lock only checks presence;
an object evicted in between also loads as a miss.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from kvreel.connector.lmcache import serde  # registers the "kvreel" serde
from kvreel.connector.lmcache.kv_object import (decode_object, encode_object, group_tensors,
                                                object_length, verify_object)
from kvreel.codec.formats import ChunkError, lmcache_object_key
from kvreel.connector.tiers.store import RemoteError, delete_quietly, open_store

logger = logging.getLogger(__name__)


def store_key(key: ObjectKey) -> str:
    return lmcache_object_key(serde.object_key_string(key), "mp")


class KVReelL2AdapterConfig(L2AdapterConfigBase):
    def __init__(self, url: str, timeout_s: float = 2.0, max_object_bytes: int = 256 << 20, workers: int = 2):
        self.url, self.timeout_s, self.max_object_bytes, self.workers = url, timeout_s, max_object_bytes, workers

    @classmethod
    def from_dict(cls, d: dict) -> "KVReelL2AdapterConfig":
        unknown = set(d) - {"type", "url", "timeout_s", "max_object_bytes", "workers"}
        if unknown:
            raise ValueError(f"unknown kvreel adapter parameter(s) {sorted(unknown)}")
        url = d.get("url")
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "file://")):
            raise ValueError("url must be a redis://, rediss:// or file:// URL")
        cfg = cls(url, float(d.get("timeout_s", 2.0)), int(d.get("max_object_bytes", 256 << 20)),
                  int(d.get("workers", 2)))
        if cfg.timeout_s <= 0 or cfg.max_object_bytes <= 0 or cfg.workers < 1:
            raise ValueError("timeout_s and max_object_bytes must be > 0, workers >= 1")
        return cfg

    @classmethod
    def help(cls) -> str:
        return __doc__


class KVReelL2Adapter(L2AdapterInterface):
    def __init__(self, config: KVReelL2AdapterConfig | dict, **_ignored):
        if isinstance(config, dict):
            config = KVReelL2AdapterConfig.from_dict(config)
        super().__init__()
        self.config = config
        self.store = open_store(config.url, timeout_s=config.timeout_s, max_value_bytes=config.max_object_bytes)
        self._efd = {op: create_event_notifier() for op in ("store", "lookup", "load")}
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kvreel-l2")
        self._lock = threading.Lock()
        self._next_id = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self.errors = 0

    # --- event fds ---
    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    def _submit(self, fn, results: dict, op: str, *args) -> L2TaskId:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1

        def run():
            result = fn(*args)
            with self._lock:
                results[task_id] = result
            self._efd[op].notify()
        self._pool.submit(run)
        return task_id

    def _pop(self, results: dict, task_id: L2TaskId):
        with self._lock:
            return results.pop(task_id, None)

    def _warn(self, what: str, e: Exception) -> None:
        self.errors += 1
        logger.warning("kvreel L2: %s failed: %s", what, e)

    # --- store ---
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._store, self._stores, "store", list(keys), list(objects))

    def _store(self, keys, objects) -> L2StoreResult:
        try:
            values = {store_key(k): self._value(k, o) for k, o in zip(keys, objects, strict=True)}
            self.store.put_many(values)
        except (RemoteError, ValueError) as e:
            self._warn("store", e)
            return L2StoreResult(False, 0)
        self._notify_keys_stored(keys, [len(v) for v in values.values()])
        return L2StoreResult(True, sum(len(v) for v in values.values()))

    @staticmethod
    def _value(key: ObjectKey, obj: MemoryObj) -> bytes:
        data = serde.object_bytes(obj).numpy()
        n = object_length(data)
        if n is not None:    # written by the kvreel serde: keep its real size
            return data[:n].tobytes()
        return encode_object(serde.object_key_string(key), group_tensors(obj), form="raw")

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # --- lookup ---
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc] | None = None) -> L2TaskId:
        return self._submit(self._lookup, self._lookups, "lookup", list(keys))

    def _lookup(self, keys) -> Bitmap:
        bits = Bitmap(len(keys))
        try:
            present = self.store.exists([store_key(k) for k in keys])
        except RemoteError as e:
            self._warn("lookup", e)
            return bits
        bits.batched_set([i for i, p in enumerate(present) if p])
        return bits

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop(self._lookups, task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing to release: the stores cannot pin objects."""

    # --- load ---
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._load, self._loads, "load", list(keys), list(objects))

    def _load(self, keys, objects) -> Bitmap:
        bits = Bitmap(len(keys))
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            skey = store_key(key)
            try:
                data = self.store.get(skey)
                if data is None:
                    continue
                self._fill(key, obj, data)
                bits.set(i)
            except RemoteError as e:
                self._warn("load", e)
            except ChunkError as e:
                self._warn(f"load of a damaged object {skey}", e)
                delete_quietly(self.store, skey)
        if bits.popcount():
            self._notify_keys_accessed([k for i, k in enumerate(keys) if bits.test(i)])
        return bits

    @staticmethod
    def _fill(key: ObjectKey, obj: MemoryObj, data: bytes) -> None:
        groups, key_str = group_tensors(obj), serde.object_key_string(key)
        out = serde.object_bytes(obj)
        sections = verify_object(data, key_str)
        if len(groups) == 1 and groups[0].dim() == 1 and groups[0].dtype == torch.uint8 \
                and [g["shape"] for g, _ in sections] != [list(groups[0].shape)]:
            # the kvreel serde's byte buffer: the object lands verbatim (already
            # verified); the deserializer decodes it
            if len(data) > out.numel():
                raise ChunkError(f"kv object of {len(data)} bytes exceeds the {out.numel()}-byte buffer")
            out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return
        decode_object(data, key_str, groups, device=obj.raw_tensor.device)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop(self._loads, task_id)

    # --- eviction / lifecycle ---
    def delete(self, keys: list[ObjectKey]) -> None:
        for k in keys:
            try:
                self.store.delete(store_key(k))
            except RemoteError as e:
                self._warn("delete", e)

    def report_status(self) -> dict:
        return {"is_healthy": True, "type": "KVReelL2Adapter", "url": getattr(self.store, "url", ""),
                "errors": self.errors}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
        for n in self._efd.values():
            n.close()
