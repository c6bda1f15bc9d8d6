"""The disk tier's file format on real files: round trips, damage detection,
failed writes reported exactly once."""

import os
import sys
import threading
import time

import pytest
import torch

from kvreel.codec.formats import ChunkError, read_chunk
from kvreel.connector.tiers import TierChanges
from kvreel.connector.tiers.disk import DiskTier, scan_chunk_files

ID = "model-a"


def payload(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, n, 4096), dtype=torch.uint8, generator=g)


def write(tmp_path, key=b"\x01" * 32, data=None, identity=ID):
    tier = DiskTier(tmp_path, identity, 0, queue_size=4)
    data = payload() if data is None else data
    hashes = [bytes([i]) * 32 for i in range(data.shape[1])]
    assert tier.put(key, hashes, data)
    tier.flush()
    tier.close()
    return tier.path(key), data, hashes


def read_file(path, identity=ID):
    with open(path, "rb") as f:
        return read_chunk(f, identity)


def test_round_trip_is_byte_exact(tmp_path):
    path, data, hashes = write(tmp_path)
    header, back = read_file(path)
    assert torch.equal(back, data)
    assert list(header.block_hashes) == hashes
    [(key, found, scanned)] = list(scan_chunk_files(tmp_path, ID))
    assert key == b"\x01" * 32 and found == path and scanned.shape == (2, 3, 4096)


def test_the_writer_thread_runs_below_the_engines_priority(tmp_path):
    """Writes behind yield the CPU to the engine's steps (a thread's own nice value)."""
    from kvreel.connector.tiers import WRITER_NICE
    tier = DiskTier(tmp_path, ID, 0, queue_size=4)
    try:
        assert tier.put(b"\x02" * 32, [b"\x00" * 32] * 3, payload())
        tier.flush()
        [writer] = [t for t in threading.enumerate() if t is tier._thread]
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, mine + WRITER_NICE)
    finally:
        tier.close()


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
    with pytest.raises(ChunkError, match=message):
        read_file(path)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset, 0 if offset >= 0 else 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def test_foreign_identity_is_refused(tmp_path):
    path, _, _ = write(tmp_path, identity="model-b")
    with pytest.raises(ChunkError, match="belongs to another model/layout"):
        read_file(path)


def test_unwritable_directory_disables_the_tier(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tier = DiskTier(blocker, ID, 0, queue_size=4)
    changes = tier.take_changes()
    assert not tier.enabled and "is not writable" in changes.went_off and not changes.came_back
    assert tier.take_changes() == TierChanges()
    assert not tier.put(b"\x02" * 32, [b"\x00" * 32], payload(1))
    assert tier.take_failed_writes() == {b"\x02" * 32}
    assert tier.take_failed_writes() == set()
    tier.close()


def test_a_directory_that_becomes_writable_turns_the_tier_back_on(tmp_path):
    blocker = tmp_path / "disk"
    blocker.write_text("x")                    # where the tier's directory should be: not writable
    tier = DiskTier(blocker, ID, 0, queue_size=4)
    assert not tier.enabled and "is not writable" in tier.take_changes().went_off
    blocker.unlink()                           # the operator frees it; the writer's probe finds out
    deadline = time.monotonic() + 10
    while not tier.enabled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.enabled and tier.take_changes() == TierChanges(came_back=True)
    key, data = b"\x03" * 32, payload(2)
    assert tier.put(key, [bytes([i]) * 32 for i in range(2)], data)
    tier.flush()
    assert torch.equal(read_file(tier.path(key))[1], data)
    tier.close()


def test_pending_writes_are_readable_and_deletes_follow_writes(tmp_path):
    tier = DiskTier(tmp_path, ID, 0, queue_size=8)
    key, data = b"\x03" * 32, payload(2)
    tier.put(key, [b"a" * 32, b"b" * 32], data)
    assert torch.equal(tier.get(key), data)
    tier.delete(key)
    tier.flush()
    assert not tier.path(key).exists()
    with pytest.raises(ChunkError, match="missing"):
        tier.get(key)
    tier.close()


def test_no_failed_write_is_lost_while_failures_are_taken(tmp_path):
    """The worker takes failed writes while writes keep failing on other threads
    (the writer thread, the forward pass): every failure is reported once. A
    take that copied the list and then cleared it lost the failures landing in
    between, and the scheduler believed those chunks were on disk."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tier = DiskTier(blocker, ID, 0, queue_size=4)          # disabled: every put fails
    keys = [i.to_bytes(4, "big") * 8 for i in range(20000)]
    taken: list[set[bytes]] = []
    done = threading.Event()

    def take():
        while not done.is_set():
            taken.append(tier.take_failed_writes())
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                              # interleave the threads as much as possible
    try:
        taker = threading.Thread(target=take)
        taker.start()
        small = payload(1)
        for key in keys:
            tier.put(key, [key], small)
        done.set()
        taker.join(timeout=60)
        assert not taker.is_alive()
    finally:
        sys.setswitchinterval(switch)
    taken.append(tier.take_failed_writes())
    reported = [k for batch in taken for k in batch]
    assert len(reported) == len(keys) and set(reported) == set(keys)
    tier.close()
