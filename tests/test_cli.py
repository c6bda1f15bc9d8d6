"""The kvreel command: doctor and inspect on real files and a real Redis."""

import os
import subprocess
import sys

import torch

from kvreel.codec import encode_chunk
from kvreel.connector.disk_tier import DiskTier


def kvreel(*args, env=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    return subprocess.run([sys.executable, "-m", "kvreel.connector.cli", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=120)


def test_doctor_reports_tiers_and_refuses_bad_settings(tmp_path, redis_server):
    _, port = redis_server
    ok = kvreel("doctor", env={"KVREEL_DISK_DIR": str(tmp_path / "d"),
                               "KVREEL_REMOTE_URL": f"redis://:s3cret@127.0.0.1:{port}/0"})
    assert ok.returncode == 0, ok.stderr
    assert "settings" in ok.stdout and "valid" in ok.stdout
    assert f"{tmp_path}/d writable" in ok.stdout
    assert f"redis://:***@127.0.0.1:{port}/0 reachable" in ok.stdout
    assert "encoder libx265 (lossless HEVC)  available" in ok.stdout
    bad = kvreel("doctor", env={"KVREEL_CPU_BYTE": "1GiB", "KVREEL_REMOTE_URL": "redis://127.0.0.1:1/0"})
    assert bad.returncode == 1
    assert "did you mean KVREEL_CPU_BYTES?" in bad.stdout


def test_inspect_reads_both_formats(tmp_path):
    kv = torch.randn(2, 2, 40, 2, 64).to(torch.bfloat16)
    path = tmp_path / "c.kvrc"
    path.write_bytes(encode_chunk(kv, resolutions=(144,)))
    out = kvreel("inspect", str(path))
    assert out.returncode == 0 and '"container": "codec"' in out.stdout and '"resolution": 144' in out.stdout
    tier = DiskTier(tmp_path, "model-x", 0, queue_size=2)
    tier.submit_write(b"\x07" * 32, [b"\x01" * 32], torch.zeros(1, 1, 64, dtype=torch.uint8))
    tier.flush()
    tier.close()
    out = kvreel("inspect", str(tier.path(b"\x07" * 32)))
    assert out.returncode == 0 and '"identity": "model-x"' in out.stdout
    (tmp_path / "junk").write_bytes(b"hello world")
    bad = kvreel("inspect", str(tmp_path / "junk"))
    assert bad.returncode == 1 and "bad magic" in bad.stderr
