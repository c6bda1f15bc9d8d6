"""The pieces of history offload, outside an engine: vLLM's page packing
learned from its own op, the per-head slab history and its cluster-ordered
rebuild, slab selection, and the KV cache manager that frees what kvreel holds."""

from __future__ import annotations

import pytest
import torch

BS, H, D = 32, 2, 64


def isa():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(torch.bfloat16, BS, D, "auto")


def packing():
    from kvreel.connector.retrieval.page_packing import PagePacking
    return PagePacking(BS, D, torch.bfloat16, isa())


def pages_of(k, v):
    """Tokens [n * bs, H, D] as cache pages [n, H, 2 bs, D], written by vLLM's op."""
    n = k.shape[0] // BS
    cache = torch.zeros(n, H, 2 * BS, D, dtype=torch.bfloat16)
    packing().pack(k, v, cache, torch.arange(n * BS))
    return cache


@pytest.mark.parametrize("head_dim,block", [(64, 32), (128, 32), (64, 16)])
def test_unpacking_inverts_vllms_packing_byte_exactly(head_dim, block):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvreel.connector.retrieval.page_packing import PagePacking
    pp = PagePacking(block, head_dim, torch.bfloat16, _get_attn_isa(torch.bfloat16, block, head_dim, "auto"))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3 * block, 3, head_dim, generator=g).bfloat16()
    v = torch.randn(3 * block, 3, head_dim, generator=g).bfloat16()
    cache = torch.zeros(5, 3, 2 * block, head_dim, dtype=torch.bfloat16)
    pp.pack(k, v, cache, torch.arange(3 * block) + block)
    k2, v2 = pp.unpack(cache[1:4])
    assert torch.equal(k2.view(torch.int16), k.view(torch.int16))
    assert torch.equal(v2.view(torch.int16), v.view(torch.int16))


def history(blocks=12, seed=0):
    from kvreel.connector.retrieval.history import LayerHistory
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * BS, H, D, generator=g).bfloat16()
    v = torch.randn(blocks * BS, H, D, generator=g).bfloat16()
    lh = LayerHistory(H, BS, D, torch.bfloat16, packing())
    return lh, k, v


def test_history_keeps_the_sink_apart_and_hands_the_keys_to_the_dre():
    lh, k, v = history()
    pages = pages_of(k, v)
    keys = lh.append(pages[:5], 0)
    more = lh.append(pages[5:], 5)
    assert torch.equal(lh.sink, pages[0]) and lh.n_slabs == 11 and lh.num_tokens == 11 * BS
    assert torch.equal(torch.cat([keys, more], 1), k[BS:].transpose(0, 1).float())
    assert torch.equal(lh.keys(), k[BS:].transpose(0, 1).float())
    # slab s of head h is head h's share of page s + 1, byte for byte
    assert torch.equal(lh.slabs[1, 3], pages[4, 1]) and lh.tokens[0, 3].tolist() == list(range(4 * BS, 5 * BS))


def test_compaction_orders_each_heads_tokens_by_cluster_and_keeps_every_byte():
    lh, k, v = history()
    lh.append(pages_of(k, v), 0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 5, (H, lh.num_tokens), generator=g)
    lh.set_labels(BS, labels)
    assert lh.unsorted_share() == 1.0
    lh.compact()
    assert lh.unsorted_share() == 0.0 and lh.version == 1
    for h in range(H):
        tokens = lh.tokens[h, :lh.n_slabs].flatten()
        got = labels[h, tokens - BS]
        assert torch.equal(got, torch.sort(got).values)                       # clusters are consecutive
        assert sorted(tokens.tolist()) == list(range(BS, 12 * BS))            # every token, once
        for c in range(5):                                                    # token order inside a cluster
            inside = tokens[got == c]
            assert torch.equal(inside, torch.sort(inside).values)
        kk, vv = packing().unpack(lh.slabs[h, :lh.n_slabs].unsqueeze(1))
        assert torch.equal(kk[:, 0], k[tokens, h]) and torch.equal(vv[:, 0], v[tokens, h])


def test_slab_mass_sums_token_mass_and_selection_follows_it():
    from kvreel.connector.retrieval.runtime import select_slabs
    lh, k, v = history(blocks=5)
    lh.append(pages_of(k, v), 0)
    mass = torch.zeros(H, lh.num_tokens)
    mass[0, 2 * BS:3 * BS] = 0.6 / BS          # head 0: slab 2 then slab 0
    mass[0, :BS] = 0.3 / BS
    mass[0, BS:2 * BS] = 0.1 / BS
    mass[1, 3 * BS] = 1.0                      # head 1: one token of slab 3 carries everything
    slab = lh.slab_mass(mass)
    assert torch.allclose(slab[0], torch.tensor([0.3, 0.1, 0.6, 0.0]), atol=1e-6)
    kept = select_slabs(slab, alpha=0.85, budget=10)
    assert kept[0].tolist() == [2, 0] and kept[1].tolist()[0] == 3 and kept.shape == (H, 2)   # padded to one count
    assert select_slabs(slab, alpha=0.85, budget=1).tolist() == [[2], [3]]                  # the budget caps
    newest = select_slabs(slab, alpha=0.5, budget=10, unscored=1)                          # slab 3 is too new
    assert newest[0].tolist()[0] == 3 and 2 in newest[0].tolist()


def test_the_manager_frees_only_what_kvreel_holds_outside_the_window():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvreel.connector.retrieval.offload import LEDGER, HistoryOffloadManager, offloaded_spec
    spec = offloaded_spec(FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16),
                          window_tokens=64, min_tokens=256, in_flight_tokens=128)
    assert spec.skipped_tokens(held_blocks=100, num_computed_tokens=255) == 0           # short: all kept
    assert spec.skipped_tokens(held_blocks=100, num_computed_tokens=640) == (640 - 64) // BS * BS
    assert spec.skipped_tokens(held_blocks=3, num_computed_tokens=640) == 3 * BS          # only what is held
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    mgr = HistoryOffloadManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                                scheduler_block_size=BS)
    assert mgr.max_admission_blocks_per_request == -(-(256 + 2 * 128) // BS)
    mgr.allocate_new_blocks("r", 20 * BS, 20 * BS)
    free = pool.get_num_free_blocks()
    mgr.remove_skipped_blocks("r", 20 * BS)                   # kvreel holds nothing yet: nothing goes
    assert pool.get_num_free_blocks() == free
    LEDGER.hold("r", 8)
    mgr.remove_skipped_blocks("r", 20 * BS)                   # 8 held, all outside the window
    assert pool.get_num_free_blocks() == free + 8
    assert [b.is_null for b in mgr.req_to_blocks["r"][:9]] == [True] * 8 + [False]
    mgr.free("r")
    assert LEDGER.held("r") == 0                              # a new admission holds anew


def test_histories_are_charged_to_the_host_budget_and_push_chunks_to_disk(tmp_path, caplog):
    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.scheduler_side import Chunk, KVReelScheduler
    from kvreel.connector.tiers import Tier
    cfg = KVReelConfig.load(env={"KVREEL_RETRIEVAL": "resv", "KVREEL_CPU_BYTES": "10KiB",
                                 "KVREEL_DISK_DIR": str(tmp_path), "KVREEL_DISK_BYTES": "1MiB",
                                 "KVREEL_CHUNK_TOKENS": "32"})
    sched = KVReelScheduler(cfg, "model", block_size=32, bytes_per_block=1024)
    chunks = [Chunk(bytes([i]) * 16, [bytes([i])], 1024) for i in range(8)]
    for chunk in chunks:
        assert sched._admit(chunk, Tier.HOST) and sched._admit(chunk, Tier.DISK)
    chunks[0].pins = 1
    sched.history.planned["long"] = 5                    # 5 KiB of history: 3 LRU chunks leave host memory
    sched._account_histories()
    assert sched.host.used == 10 * 1024
    assert [Tier.HOST in c.tiers for c in chunks] == [True, False, False, False, True, True, True, True]
    assert all(Tier.DISK in c.tiers for c in chunks)                # their disk copies stay
    assert sched._evictions[Tier.HOST] == [c.key for c in chunks[1:4]]
    sched.history.planned["long"] = 20                   # past the budget: every unpinned chunk goes, it says so
    sched._account_histories()
    assert [Tier.HOST in c.tiers for c in chunks] == [True] + [False] * 7
    assert "exceed KVREEL_CPU_BYTES" in caplog.text
    sched.history.forget("long")                          # the session ended: its room comes back
    sched._account_histories()
    assert sched.host.used == 1024


def test_a_long_prefix_is_not_loaded_from_the_remote_tier_into_vllms_cache(tmp_path):
    """Remote blocks outside a long request's window would land in vLLM's cache
    (histories load from the local tiers): one such request could fill the cache
    and never run. They are recomputed; remote blocks inside the window still load."""
    import time
    from types import SimpleNamespace
    from kvreel.codec.forms import StoredForms
    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.scheduler_side import KVReelScheduler
    from kvreel.connector.tiers.remote import RemoteTier
    url = f"file://{tmp_path / 'store'}"
    tier = RemoteTier(url, StoredForms("model"), 2.0, 4)
    hashes = [bytes([7, j]) * 16 for j in range(16)]
    tier.put(b"\x01" * 32, hashes, torch.zeros(1, 16, 64, dtype=torch.uint8))
    assert tier.flush(120)
    tier.close()

    def matched(retrieval: str, num_tokens: int, request_id: str) -> int:
        cfg = KVReelConfig.load(env={"KVREEL_RETRIEVAL": retrieval, "KVREEL_RETRIEVAL_MIN_TOKENS": "64",
                                     "KVREEL_RETRIEVAL_WINDOW": "64", "KVREEL_CPU_BYTES": "1MiB",
                                     "KVREEL_REMOTE_URL": url})
        sched = KVReelScheduler(cfg, "model", block_size=32, bytes_per_block=64)
        request = SimpleNamespace(request_id=request_id, block_hashes=hashes[:num_tokens // 32],
                                  num_tokens=num_tokens)
        deadline = time.monotonic() + 10
        while (got := sched.get_num_new_matched_tokens(request, 0)[0]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sched.remote.close()
        return got
    assert matched("off", 16 * 32 + 5, "a") == 16 * 32                 # without retrieval: all 16 blocks load
    assert matched("resv", 16 * 32 + 5, "b") == 0                      # 13 of them outside the window: recompute
    assert matched("resv", 2 * 32 + 5, "c") == 2 * 32                  # all inside the window: they load
