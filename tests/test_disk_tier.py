"""The disk tier's file format on real files: round trips, damage detection."""

import os

import pytest
import torch

from kvreel.connector.disk_tier import ChunkFileError, DiskTier, read_chunk_file, scan_chunk_headers

ID = "model-a"


def payload(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, n, 4096), dtype=torch.uint8, generator=g)


def write(tmp_path, key=b"\x01" * 32, data=None, identity=ID):
    tier = DiskTier(tmp_path, identity, 0, queue_size=4)
    data = payload() if data is None else data
    hashes = [bytes([i]) * 32 for i in range(data.shape[1])]
    assert tier.submit_write(key, hashes, data)
    tier.flush()
    tier.close()
    return tier.path(key), data, hashes


def test_round_trip_is_byte_exact(tmp_path):
    path, data, hashes = write(tmp_path)
    header, back = read_chunk_file(path, ID)
    assert torch.equal(back, data)
    assert list(header.block_hashes) == hashes
    [(key, scanned)] = list(scan_chunk_headers(tmp_path, ID))
    assert key == b"\x01" * 32 and scanned.shape == (2, 3, 4096)


@pytest.mark.parametrize("damage,message", [
    (lambda p: open(p, "r+b").truncate(os.path.getsize(p) - 1), "payload is"),
    (lambda p: open(p, "r+b").truncate(20), "truncated header"),
    (lambda p: _flip(p, -5), "payload checksum mismatch"),
    (lambda p: _flip(p, 30), "header checksum mismatch"),
    (lambda p: _flip(p, 0), "bad magic"),
])
def test_damage_is_detected(tmp_path, damage, message):
    path, _, _ = write(tmp_path)
    damage(path)
    with pytest.raises(ChunkFileError, match=message):
        read_chunk_file(path, ID)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset, 0 if offset >= 0 else 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def test_foreign_identity_is_refused(tmp_path):
    path, _, _ = write(tmp_path, identity="model-b")
    with pytest.raises(ChunkFileError, match="belongs to another model/layout"):
        read_chunk_file(path, ID)


def test_unwritable_directory_disables_the_tier(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    reasons = []
    tier = DiskTier(blocker, ID, 0, queue_size=4, on_error=reasons.append)
    assert not tier.enabled and "is not writable" in reasons[0]
    assert not tier.submit_write(b"\x02" * 32, [b"\x00" * 32], payload(1))
    assert tier.failed_keys == [b"\x02" * 32]
    tier.close()


def test_pending_writes_are_readable_and_deletes_follow_writes(tmp_path):
    tier = DiskTier(tmp_path, ID, 0, queue_size=8)
    key, data = b"\x03" * 32, payload(2)
    tier.submit_write(key, [b"a" * 32, b"b" * 32], data)
    assert torch.equal(tier.read(key), data)
    tier.submit_delete(key)
    tier.flush()
    assert not tier.path(key).exists()
    with pytest.raises(ChunkFileError, match="missing"):
        tier.read(key)
    tier.close()
