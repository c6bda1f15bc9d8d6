"""Untrusted bytes (files, store values, containers) are bounded and never unpickled."""

import re
import struct
from pathlib import Path

import pytest

from kvreel.codec import ChunkError, decode_chunk
from kvreel.codec.formats import CHUNK_FILE, read_chunk
from kvreel.connector.tiers.store import RemoteError, open_store

ROOT = Path(__file__).parents[1]


def test_no_unpickling_in_the_package():
    for folder in ("connector", "codec", "scheduler", "dre", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"\bimport pickle\b|\bpickle\.loads?\b|\btorch\.load\b|\bmarshal\b", text), path


def test_oversized_headers_are_refused_before_reading_them(tmp_path):
    huge = struct.pack("<4sHI", b"KVRC", 1, 1 << 30)
    with pytest.raises(ChunkError, match="exceeds"):
        decode_chunk(huge + b"x" * 16)
    path = tmp_path / "f.kvr"
    path.write_bytes(struct.pack("<4sHI", CHUNK_FILE.magic, 1, 1 << 30) + b"x" * 16)
    with pytest.raises(ChunkError, match="exceeds"), open(path, "rb") as f:
        read_chunk(f, "m")


def test_store_values_over_the_limit_are_not_fetched(redis_server):
    import redis
    _, port = redis_server
    redis.Redis(port=port, password="s3cret").set("kvreel/m/c/big", b"x" * 5000)
    store = open_store(f"redis://:s3cret@127.0.0.1:{port}/0", max_value_bytes=4096)
    with pytest.raises(RemoteError, match="over the 4096-byte limit"):
        store.get("kvreel/m/c/big")


def test_servers_started_by_kvreel_bind_loopback():
    cli = (ROOT / "cli" / "main.py").read_text()
    assert '"--host", "127.0.0.1"' in cli
    assert "0.0.0.0" not in cli


def test_the_dre_never_opens_or_deletes_a_segment_it_did_not_create():
    from multiprocessing import shared_memory
    import torch
    from kvreel.dre.wire import DREError, put_tensor, take_tensor
    victim = shared_memory.SharedMemory(create=True, size=64)
    try:
        victim.buf[:4] = b"mine"
        for name in (victim.name, "kvreel-dre-1-../x", "kvreel-dre-12"):
            with pytest.raises(DREError, match="not one kvreel created"):
                take_tensor({"shm": name, "shape": [4], "dtype": "float32"})
        again = shared_memory.SharedMemory(name=victim.name)         # still there, intact
        assert bytes(again.buf[:4]) == b"mine"
        again.close()
    finally:
        victim.close()
        victim.unlink()
    desc = put_tensor(torch.arange(3))
    assert desc["shm"].startswith("kvreel-dre-") and torch.equal(take_tensor(desc), torch.arange(3))


def test_the_dre_refuses_a_public_address_without_a_secret():
    import os
    import subprocess
    import sys
    from kvreel.cli.server_process import free_port
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    out = subprocess.run([sys.executable, "-m", "kvreel.cli.main", "dre", "--address", f"0.0.0.0:{free_port()}"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("kvreel dre: refusing to serve 0.0.0.0:")
    assert "KVREEL_DRE_SECRET_HEX" in out.stderr
