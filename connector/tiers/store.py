"""Remote chunk stores behind ``KVREEL_REMOTE_URL``.

* ``redis://[:password@]host:port/db`` — a real Redis (redis-py), with connect
  and read timeouts so a dead or slow store costs a bounded wait, never a hang.
* ``redis-cluster://[:password@]host:port[,host:port...]`` — a Redis Cluster
  (or Valkey's), any nodes as seeds, through redis-py's cluster client: it
  follows MOVED/ASK during resharding and finds a promoted replica; pipelines
  and multi-key reads are split per node.
* ``file:///path`` — a shared filesystem; keys map to files strictly inside the
  root (no path traversal), written atomically.

Values are opaque bytes (kvreel's self-checking stored forms, keys from
``kvreel.codec.formats.StoreKeys``); nothing read from a store is ever
unpickled. Every value is size-limited both ways.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._/{}-]{0,255}$")


class RemoteError(Exception):
    """The store could not be reached, timed out, or refused the operation."""


class RemoteStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def get_range(self, key: str, start: int, length: int) -> bytes | None: ...
    def exists(self, keys: list[str]) -> list[bool]: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def put_many(self, items: dict[str, bytes]) -> None: ...
    def delete(self, key: str) -> None: ...
    def close(self) -> None: ...


class ThrottledWarning:
    """Log a recurring failure at most once per ``every`` seconds."""

    def __init__(self, logger: logging.Logger, every: float = 30.0):
        self.logger, self.every, self.last = logger, every, 0.0

    def warn(self, msg, *args):
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.logger.warning(msg, *args)


def delete_quietly(store: "RemoteStore", key: str) -> None:
    """Remove a damaged value so that lookups stop offering it; an unreachable
    store is not an error here (the value is refused on every read anyway)."""
    try:
        store.delete(key)
    except RemoteError:
        pass


def _check_key(key: str) -> str:
    if not KEY_RE.match(key) or ".." in key.split("/"):
        raise ValueError(f"invalid store key {key!r}")
    return key


class RedisStore:
    def __init__(self, url: str, *, timeout_s: float, max_value_bytes: int):
        import redis
        self.url = url
        self.max_value_bytes = max_value_bytes
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False, health_check_interval=30)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ResponseError, redis.exceptions.AuthenticationError, OSError)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as e:
            raise RemoteError(f"redis store {redact_url(self.url)}: {type(e).__name__}: {e}") from None

    def put(self, key: str, data: bytes) -> None:
        _limit(len(data), self.max_value_bytes, key)
        self._call(self._client.set, _check_key(key), data)

    def get(self, key: str) -> bytes | None:
        size = self._call(self._client.strlen, _check_key(key))
        if not size:
            return None
        _limit(size, self.max_value_bytes, key)
        return self._call(self._client.get, key)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        _limit(length, self.max_value_bytes, key)
        data = self._call(self._client.getrange, _check_key(key), start, start + length - 1)
        return data if data else None

    def exists(self, keys: list[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(_check_key(k))
        return [bool(x) for x in self._call(pipe.execute)]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Small values only (block pointers): one MGET round trip."""
        if not keys:
            return []
        return self._call(self._mget, [_check_key(k) for k in keys])

    def _mget(self, keys: list[str]) -> list[bytes | None]:
        return self._client.mget(keys)

    def put_many(self, items: dict[str, bytes]) -> None:
        for k, v in items.items():
            _limit(len(v), self.max_value_bytes, k)
        pipe = self._client.pipeline(transaction=False)
        for k, v in items.items():
            pipe.set(_check_key(k), v)
        self._call(pipe.execute)

    def delete(self, key: str) -> None:
        self._call(self._client.delete, _check_key(key))

    def close(self) -> None:
        self._client.close()


class RedisClusterStore(RedisStore):
    """A Redis Cluster: the same operations, with redis-py's cluster client."""

    def __init__(self, url: str, *, timeout_s: float, max_value_bytes: int):
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry
        self.url = url
        self.max_value_bytes = max_value_bytes
        password, nodes = parse_cluster_url(url)
        try:
            self._client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], password=password,
                                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        require_full_coverage=False, retry=Retry(NoBackoff(), 1))
        except (redis.exceptions.RedisError, OSError) as e:
            raise RemoteError(f"redis cluster {redact_url(url)}: {type(e).__name__}: {e}") from None
        # every redis-py error is the store's failing (a node down, a slot moving, no coverage)
        self._errors = (redis.exceptions.RedisError, OSError)
        # a node gone or a slot without a master: the client refreshes its view of the
        # cluster on each; tried again until the timeout (a promoted replica takes over)
        self._passing = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                         redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError)
        self._timeout_s = timeout_s

    def _call(self, fn, *args):
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                return fn(*args)
            except self._passing as e:
                if time.monotonic() >= deadline:
                    raise RemoteError(f"redis cluster {redact_url(self.url)}: {type(e).__name__}: {e}") from None
                time.sleep(0.1)
            except self._errors as e:
                raise RemoteError(f"redis cluster {redact_url(self.url)}: {type(e).__name__}: {e}") from None

    def _mget(self, keys: list[str]) -> list[bytes | None]:
        return self._client.mget_nonatomic(keys)          # one MGET per slot, pipelined per node

    def nodes(self) -> list[str]:
        """``host:port flags`` of every node, as the cluster sees them (CLUSTER NODES:
        master/slave, fail?, fail; for kvreel doctor)."""
        seen = self._call(self._client.cluster_nodes)
        return sorted(f"{addr.split('@')[0]} {info['flags'].replace('myself,', '')}" for addr, info in seen.items())


def parse_cluster_url(url: str) -> tuple[str | None, list[tuple[str, int]]]:
    """``redis-cluster://[:password@]host:port[,host:port...]`` -> (password, seed nodes)."""
    rest = url.removeprefix("redis-cluster://")
    password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        password = unquote(auth.partition(":")[2]) or None
    nodes = []
    for part in filter(None, rest.rstrip("/").split(",")):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis-cluster URL node {part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError("a redis-cluster URL names at least one host:port")
    return password, nodes


class FileStore:
    def __init__(self, url: str, *, max_value_bytes: int):
        self.url = url
        self.root = Path(unquote(urlparse(url).path)).resolve()
        self.max_value_bytes = max_value_bytes
        self._lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RemoteError(f"file store {url}: {e}") from None

    def _path(self, key: str) -> Path:
        path = (self.root / _check_key(key)).resolve()
        if self.root not in path.parents:
            raise ValueError(f"store key {key!r} escapes the store directory")
        return path

    def put(self, key: str, data: bytes) -> None:
        _limit(len(data), self.max_value_bytes, key)
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise RemoteError(f"file store put {key}: {e}") from None

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            _limit(path.stat().st_size, self.max_value_bytes, key)
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RemoteError(f"file store get {key}: {e}") from None

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        _limit(length, self.max_value_bytes, key)
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(length) or None
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RemoteError(f"file store get_range {key}: {e}") from None

    def exists(self, keys: list[str]) -> list[bool]:
        return [self._path(k).is_file() for k in keys]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: dict[str, bytes]) -> None:
        for k, v in items.items():
            self.put(k, v)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def close(self) -> None:
        return


def _limit(size: int, limit: int, key: str) -> None:
    if size > limit:
        raise RemoteError(f"value of {key} is {size} bytes, over the {limit}-byte limit")


def redact_url(url: str) -> str:
    """The URL without its password, for log lines."""
    if url.startswith("redis-cluster://") and "@" in url:
        auth, rest = url.removeprefix("redis-cluster://").rsplit("@", 1)
        return f"redis-cluster://{auth.partition(':')[0]}:***@{rest}" if ":" in auth else url
    p = urlparse(url)
    return url.replace(p.password, "***") if p.password else url


def open_store(url: str, *, timeout_s: float = 2.0, max_value_bytes: int = 256 << 20) -> RemoteStore:
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss"):
        return RedisStore(url, timeout_s=timeout_s, max_value_bytes=max_value_bytes)
    if scheme == "redis-cluster":
        return RedisClusterStore(url, timeout_s=timeout_s, max_value_bytes=max_value_bytes)
    if scheme == "file":
        return FileStore(url, max_value_bytes=max_value_bytes)
    raise ValueError(f"remote store URL must start with redis://, rediss://, redis-cluster:// or file://, "
                     f"got {redact_url(url)!r}")
