"""The connector's worker side without an engine: real paged-cache tensors on
the CPU, a fake tier beside the real host tier, driven the way vLLM's model
runner drives the connector each step."""

import threading
from types import SimpleNamespace

import torch

from kvreel.codec.formats import ChunkError, ChunkUnavailable, chunk_key
from kvreel.connector.config import KVReelConfig
from kvreel.connector.metadata import KVReelMetadata, LoadOp, LoadPiece, StoreOp
from kvreel.connector.tiers import ChunkTier, Tier, TierChanges
from kvreel.connector.worker_side.worker import KVReelWorker

LAYERS, BLOCKS, PAGE = 3, 32, 256
KEY = b"\x07" * 32


class FakeDisk(ChunkTier):
    """A disk tier in memory whose writes and state the test decides."""

    kind = Tier.DISK

    def __init__(self):
        self.chunks, self.deleted = {}, []
        self.failed, self.changes, self.damaged = set(), TierChanges(), set()
        self.gate: threading.Event | None = None        # set: writes wait for it

    def put(self, key, block_hashes, payload):
        if self.gate is not None:
            assert self.gate.wait(30)
        self.chunks[key] = payload.clone()
        return True

    def get(self, key):
        if key in self.damaged:
            raise ChunkError("payload checksum mismatch")
        if key not in self.chunks:
            raise ChunkUnavailable("no such chunk")
        return self.chunks[key]

    def delete(self, key):
        self.deleted.append(key)
        self.chunks.pop(key, None)

    def take_failed_writes(self):
        taken, self.failed = self.failed, set()
        return taken

    def take_changes(self):
        taken, self.changes = self.changes, TierChanges()
        return taken


def worker_with_fake_disk(env=None):
    cache = torch.randint(0, 255, (LAYERS, BLOCKS, PAGE), dtype=torch.uint8)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    placement = SimpleNamespace(layers=names, layer_stride=BLOCKS * PAGE, block_stride=PAGE, offset=0)
    spec = SimpleNamespace(block_size=16)
    cfg = SimpleNamespace(num_blocks=BLOCKS, kv_cache_tensors=[placement],
                          kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)])
    worker = KVReelWorker(KVReelConfig.load(env=env or {}), "model-x", 0)
    worker.register_kv_caches({n: cache[i] for i, n in enumerate(names)}, cfg, 512)
    disk = FakeDisk()
    worker.add_tier(disk)
    return worker, cache, disk


def save(worker: KVReelWorker, *stores: StoreOp) -> None:
    """A step's saves, then the next step about to write their blocks (so they are done)."""
    worker.wait_for_save(KVReelMetadata(stores=list(stores)))
    worker.before_writes(KVReelMetadata(written_blocks={b for op in stores for ids in op.block_ids for b in ids}))


def test_a_chunk_saved_to_two_tiers_loads_back_into_other_blocks_byte_for_byte():
    worker, cache, disk = worker_with_fake_disk()
    save(worker, StoreOp(KEY, [b"a" * 32, b"b" * 32], ([3, 9],), {Tier.HOST, Tier.DISK}))
    assert torch.equal(disk.chunks[KEY], cache[:, [3, 9]])
    assert torch.equal(worker.tiers[Tier.HOST].get(KEY), cache[:, [3, 9]])
    saved = cache[:, [3, 9]].clone()
    worker.start_load_kv(KVReelMetadata(loads=[LoadOp("r1", [LoadPiece(KEY, Tier.DISK, 1, ([20],))], False)]))
    assert torch.equal(cache[:, 20], saved[:, 1]) and worker.take_load_errors() == set()
    worker.start_load_kv(KVReelMetadata(evictions={Tier.DISK: [KEY]}))
    assert disk.deleted == [KEY]


def test_a_damaged_or_missing_chunk_is_reported_for_recompute_and_never_written():
    worker, cache, disk = worker_with_fake_disk()
    disk.put(KEY, [], torch.zeros(LAYERS, 2, PAGE, dtype=torch.uint8))
    disk.damaged.add(KEY)
    before = cache.clone()
    worker.start_load_kv(KVReelMetadata(loads=[
        LoadOp("r1", [LoadPiece(KEY, Tier.DISK, 0, ([5, 6],)), LoadPiece(b"\x08" * 32, Tier.DISK, 0, ([7],))], False)]))
    assert worker.take_load_errors() == {5, 6, 7}
    assert torch.equal(cache, before)
    meta = worker.take_worker_meta()
    assert meta.bad_keys == {KEY, b"\x08" * 32}


def test_a_tier_that_goes_off_is_not_driven_until_it_comes_back():
    worker, cache, disk = worker_with_fake_disk()
    disk.failed, disk.changes = {KEY}, TierChanges(went_off="No space left on device")
    meta = worker.take_worker_meta()
    assert meta.failed_writes == {Tier.DISK: {KEY}} and meta.tiers_off == {Tier.DISK: "No space left on device"}
    assert Tier.DISK not in worker.tiers
    save(worker, StoreOp(KEY, [b"a" * 32], ([4],), {Tier.HOST, Tier.DISK}))
    assert KEY not in disk.chunks                              # off: nothing written to it
    worker.start_load_kv(KVReelMetadata(loads=[LoadOp("r1", [LoadPiece(KEY, Tier.DISK, 0, ([8],))], False)]))
    assert worker.take_load_errors() == {8}
    disk.changes = TierChanges(came_back=True)
    meta = worker.take_worker_meta()
    assert meta.tiers_back == {Tier.DISK} and worker.tiers[Tier.DISK] is disk
    assert worker.take_worker_meta() is None                   # nothing new to say


def test_a_remote_prefetch_goes_through_the_fetch_controller_into_host_memory(tmp_path):
    worker, cache, _ = worker_with_fake_disk({"KVREEL_REMOTE_URL": f"file://{tmp_path}"})
    try:
        hashes = [b"a" * 32, b"b" * 32]
        key = chunk_key(hashes)                              # what the remote tier serves: a key naming its blocks
        save(worker, StoreOp(key, hashes, ([2, 5],), {Tier.REMOTE}))
        assert worker.tiers[Tier.REMOTE].flush(60)
        worker.start_load_kv(KVReelMetadata(prefetches=[(key, Tier.REMOTE), (b"\x09" * 32, Tier.REMOTE)]))
        worker._prefetcher.submit(lambda: None).result(timeout=60)          # the prefetches before it are done
        assert torch.equal(worker.tiers[Tier.HOST].get(key), cache[:, [2, 5]])
        meta = worker.take_worker_meta()
        assert meta.prefetched == {key: 1} and meta.prefetch_failed == {b"\x09" * 32}
        fetches = {k: v for k, v in worker.take_stats().data.items() if k.startswith("remote_fetches|")}
        assert sum(fetches.values()) == 2                    # both tried (in whichever form), counted as loads are
    finally:
        worker.shutdown()


def test_saves_copy_while_the_next_step_runs_until_it_writes_their_blocks():
    worker, cache, disk = worker_with_fake_disk()
    disk.gate = threading.Event()
    first, second = KEY, b"\x08" * 32
    before = cache[:, 9].clone()
    # one step's two saves: the first waits on the disk, the second copies block 9 after it
    worker.wait_for_save(KVReelMetadata(stores=[StoreOp(first, [b"a" * 32], ([3],), {Tier.DISK}),
                                                StoreOp(second, [b"b" * 32], ([9],), {Tier.HOST})]))
    worker.before_writes(KVReelMetadata(written_blocks={4, 10}))     # the next step writes other blocks: no wait
    assert first not in disk.chunks and second not in worker.tiers[Tier.HOST]._chunks
    threading.Timer(0.3, disk.gate.set).start()
    worker.before_writes(KVReelMetadata(written_blocks={9}))          # it writes block 9: the saves finish first
    cache[:, 9] = 0
    assert torch.equal(worker.tiers[Tier.HOST].get(second)[:, 0], before)
    assert torch.equal(disk.chunks[first], cache[:, [3]])
    worker.shutdown()


def test_a_chunk_still_being_saved_is_loaded_and_deleted_only_once_stored():
    worker, cache, disk = worker_with_fake_disk()
    disk.gate = threading.Event()
    worker.wait_for_save(KVReelMetadata(stores=[StoreOp(KEY, [b"a" * 32], ([3],), {Tier.DISK})]))
    threading.Timer(0.3, disk.gate.set).start()
    worker.start_load_kv(KVReelMetadata(loads=[LoadOp("r1", [LoadPiece(KEY, Tier.DISK, 0, ([20],))], False)]))
    assert worker.take_load_errors() == set() and torch.equal(cache[:, 20], cache[:, 3])
    disk.gate.clear()
    worker.wait_for_save(KVReelMetadata(stores=[StoreOp(b"\x08" * 32, [b"b" * 32], ([5],), {Tier.DISK})]))
    threading.Timer(0.3, disk.gate.set).start()
    worker.start_load_kv(KVReelMetadata(evictions={Tier.DISK: [b"\x08" * 32]}))
    assert disk.deleted == [b"\x08" * 32] and b"\x08" * 32 not in disk.chunks     # deleted after it was written
    worker.shutdown()


def test_with_save_copy_step_a_save_is_done_when_its_step_ends():
    worker, cache, disk = worker_with_fake_disk({"KVREEL_SAVE_COPY": "step"})
    worker.wait_for_save(KVReelMetadata(stores=[StoreOp(KEY, [b"a" * 32], ([3],), {Tier.DISK})]))
    assert not worker.saver.on_thread and torch.equal(disk.chunks[KEY], cache[:, [3]])     # no fence needed


def test_a_load_from_the_host_tier_runs_through_five_package_modules_at_most():
    """Every kvreel function a host-tier load calls, traced: the worker, its save
    fences, the host tier, the page copy and the reports, besides the step's
    message (``metadata``: a property of the piece) and the counters
    (``stats``), which every path uses. A load that wandered through more
    rooms would be harder to follow and to keep fast."""
    import sys
    worker, cache, _ = worker_with_fake_disk()
    save(worker, StoreOp(KEY, [b"a" * 32], ([3],), {Tier.HOST}))
    saved = cache[:, 3].clone()
    meta = KVReelMetadata(loads=[LoadOp("r1", [LoadPiece(KEY, Tier.HOST, 0, ([20],))], False)])
    touched = set()

    def note(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("kvreel."):
            touched.add(frame.f_globals["__name__"])
    sys.setprofile(note)
    try:
        worker.start_load_kv(meta)
    finally:
        sys.setprofile(None)
    assert torch.equal(cache[:, 20], saved) and worker.take_load_errors() == set()
    assert len(touched - {"kvreel.connector.metadata", "kvreel.connector.stats"}) <= 5, sorted(touched)
    assert {"kvreel.connector.worker_side.worker", "kvreel.connector.tiers.host",
            "kvreel.connector.worker_side.block_copy"} <= touched, sorted(touched)
