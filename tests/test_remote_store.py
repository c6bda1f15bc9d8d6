"""Remote stores against a real Redis (Debian's redis-server on loopback) and real files."""

from __future__ import annotations

import time

import pytest

from kvreel.codec.formats import StoreKeys
from kvreel.connector.tiers.store import RemoteError, open_store


@pytest.fixture(params=["redis", "file"])
def store(request, tmp_path):
    if request.param == "redis":
        _, port = request.getfixturevalue("redis_server")
        s = open_store(f"redis://:s3cret@127.0.0.1:{port}/0", timeout_s=1.0, max_value_bytes=1 << 20)
    else:
        s = open_store(f"file://{tmp_path}/store", max_value_bytes=1 << 20)
    yield s
    s.close()


def test_round_trip_range_exists_delete(store):
    key = StoreKeys("model-a").chunk(bytes(range(32)))
    data = bytes(range(256)) * 100
    assert store.get(key) is None
    store.put(key, data)
    assert store.get(key) == data
    assert store.get_range(key, 1000, 300) == data[1000:1300]
    assert store.exists([key, key + "x"]) == [True, False]
    store.delete(key)
    assert store.get(key) is None


def test_size_limits_both_ways(store):
    with pytest.raises(RemoteError, match="over the 1048576-byte limit"):
        store.put("kvreel/m/big", bytes((1 << 20) + 1))


def test_keys_cannot_escape(store):
    for bad in ("../etc/passwd", "kvreel/../../x", "/abs", "a b", ""):
        with pytest.raises(ValueError, match="invalid store key|escapes"):
            store.put(bad, b"x")


def test_wrong_password_and_dead_store_fail_fast(redis_server):
    proc, port = redis_server
    bad = open_store(f"redis://:wrong@127.0.0.1:{port}/0", timeout_s=1.0)
    with pytest.raises(RemoteError, match="AuthenticationError|ResponseError|invalid"):
        bad.get("kvreel/m/k")
    good = open_store(f"redis://:s3cret@127.0.0.1:{port}/0", timeout_s=1.0)
    good.put("kvreel/m/k", b"v")
    proc.kill()
    proc.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="ConnectionError|TimeoutError"):
        good.get("kvreel/m/k")
    assert time.monotonic() - t0 < 5


def test_unknown_scheme():
    with pytest.raises(ValueError, match="must start with redis://"):
        open_store("http://127.0.0.1/x")
