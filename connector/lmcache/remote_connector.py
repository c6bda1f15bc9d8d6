"""kvreel's remote store and codec for in-process LMCache (``remote_storage_plugins``).

LMCache config (YAML or ``LMCACHE_*`` env)::

    remote_url: "plugin://kvreel"
    remote_storage_plugins: ["kvreel"]
    extra_config:
      remote_storage_plugin.kvreel.module_path: kvreel.connector.lmcache.remote_connector
      remote_storage_plugin.kvreel.class_name: KVReelConnectorAdapter
      kvreel.url: redis://127.0.0.1:6379/0      # or file:///shared/kvreel
      kvreel.form: video                        # video | zstd | raw
      kvreel.quant: none                        # none (exact) | int8 (video only)

LMCache's own serde list is closed and its async-loading path skips
deserialization, so the codec runs inside ``put``/``get`` here. Objects are
kvreel's self-checking form (``kv_object``); a damaged or foreign one is a
miss (logged, deleted), never wrong KV.
"""

from __future__ import annotations

import asyncio
import logging
from typing import List, Optional

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvreel.connector.lmcache.kv_object import (check_options, decode_object, encode_object,
                                                group_tensors, object_groups)
from kvreel.codec.formats import ChunkError, lmcache_object_key
from kvreel.connector.tiers.store import RemoteError, delete_quietly, open_store

logger = logging.getLogger(__name__)
PLUGIN = "kvreel"


def store_key(key: CacheEngineKey) -> str:
    return lmcache_object_key(key.to_string(), "v1")


class KVReelRemoteConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, metadata):
        super().__init__(config, metadata)
        extra = dict(config.extra_config or {}) if config is not None else {}
        url = extra.get("kvreel.url")
        if not url:
            raise ValueError("kvreel LMCache plugin: set extra_config 'kvreel.url' (redis://... or file://...)")
        self.form = str(extra.get("kvreel.form", "video"))
        self.quant = str(extra.get("kvreel.quant", "none"))
        check_options(self.form, self.quant)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.store = open_store(url, timeout_s=float(extra.get("kvreel.timeout_s", 2.0)))
        self.errors = 0

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self.store.exists([store_key(key)])[0]
        except RemoteError as e:
            self._warn("lookup", e)
            return False

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self.exists_sync, key)

    def _put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        data = encode_object(key.to_string(), group_tensors(memory_obj), form=self.form, quant=self.quant)
        try:
            self.store.put(store_key(key), data)
        except (RemoteError, ValueError) as e:
            self._warn("put", e)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        await self._run(self._put, key, memory_obj)

    def _get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        skey = store_key(key)
        try:
            data = self.store.get(skey)
            if data is None:
                return None
            groups = object_groups(data)
            obj = self.local_cpu_backend.allocate([s for s, _ in groups], [d for _, d in groups], self.meta_fmt)
            if obj is None:
                logger.warning("kvreel LMCache plugin: no host memory for a fetched chunk")
                return None
            try:
                decode_object(data, key.to_string(), group_tensors(obj))
            except ChunkError:
                obj.ref_count_down()
                raise
            return obj
        except RemoteError as e:
            self._warn("get", e)
        except ChunkError as e:
            self._warn(f"get of a damaged object {skey}", e)
            delete_quietly(self.store, skey)
        return None

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return await self._run(self._get, key)

    async def list(self) -> List[str]:
        """Keys are stored hashed, so the store cannot list LMCache keys."""
        return []

    async def close(self):
        self.store.close()

    def _warn(self, what: str, e: Exception) -> None:
        self.errors += 1
        logger.warning("kvreel LMCache plugin: %s failed: %s", what, e)


class KVReelConnectorAdapter(ConnectorAdapter):
    """Loaded by LMCache's ``remote_storage_plugins`` launcher; builds the connector."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN}")

    def can_parse(self, url: str) -> bool:
        return url.startswith(self.schema)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KVReelRemoteConnector(context.loop, context.local_cpu_backend, context.config, context.metadata)
