"""Retrieval attention on vLLM's real CPU kernels, outside an engine: a long
request whose history lives in kvreel (its pages copied out, as the connector
does) attends exactly as vLLM does over its own cache when every history page
is kept, and to the sink, the kept slabs and the resident blocks otherwise;
short requests in the same batch are untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

BS, H, G, D = 32, 2, 2, 64


@pytest.fixture
def setup(tiny_model, monkeypatch):
    monkeypatch.delenv("KVREEL_TEST_MODEL_CACHE", raising=False)    # not a kvreel setting
    for k, v in {"KVREEL_RETRIEVAL": "resv", "KVREEL_RETRIEVAL_ALPHA": "1", "KVREEL_RETRIEVAL_MIN_TOKENS": "64",
                 "KVREEL_RETRIEVAL_WINDOW": "32", "KVREEL_RETRIEVAL_BUDGET_TOKENS": "1024",
                 "KVREEL_RETRIEVAL_BUDGET_SHARE": "1"}.items():
        monkeypatch.setenv(k, v)
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config

    from kvreel.connector.retrieval.attention_backend import RetrievalAttentionImpl
    from kvreel.connector.retrieval.runtime import RetrievalRuntime
    RetrievalRuntime._built = None
    # vLLM's kernel uses AMX tiles where the CPU has them; the process must have asked
    # the kernel for them first, as an engine's start does (alone, this file would die of SIGILL)
    torch.cpu._init_amx()
    config = VllmConfig(model_config=ModelConfig(model=tiny_model), kv_transfer_config=KVTransferConfig(
        kv_connector="KVReelConnector", kv_connector_module_path="kvreel.connector", kv_role="kv_both"))
    with set_current_vllm_config(config):
        impl = RetrievalAttentionImpl(num_heads=H * G, head_size=D, scale=D ** -0.5, num_kv_heads=H,
                                      alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
        yield impl, RetrievalRuntime._built
    RetrievalRuntime._built = None


def _batch(seq_lens: list[int], q_lens: list[int], num_blocks: int, g: torch.Generator):
    """Two requests in one cache with shuffled physical blocks; their KV written by vLLM's op."""
    from kvreel.connector.vllm_internals import cpu_attn_isa, cpu_reshape_and_cache
    isa = cpu_attn_isa(torch.bfloat16, BS, D)
    layer = SimpleNamespace(isa=isa, layer_name="model.layers.0.self_attn.attn", _k_scale_float=1.0,
                            _v_scale_float=1.0)
    cache = torch.zeros(num_blocks, H, BS, 2 * D, dtype=torch.bfloat16)
    physical = torch.randperm(num_blocks - 1, generator=g) + 1
    rows, used = [], 0
    width = max(-(-s // BS) for s in seq_lens)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for r, s in enumerate(seq_lens):
        n = -(-s // BS)
        table[r, :n] = physical[used:used + n]
        used += n
        slots = table[r].long()[torch.arange(s) // BS] * BS + torch.arange(s) % BS
        k, v = torch.randn(s, H, D, generator=g).bfloat16(), torch.randn(s, H, D, generator=g).bfloat16()
        cpu_reshape_and_cache(k, v, *cache.view(num_blocks, H, 2 * BS, D).chunk(2, dim=2), slots, isa)
        rows.append(table[r])
    meta = _metadata(seq_lens, q_lens, table, isa)
    query = torch.randn(int(meta.query_start_loc[-1]), H * G, D, generator=g).bfloat16()
    return layer, cache, meta, query


def _metadata(seq_lens: list[int], q_lens: list[int], table: torch.Tensor, isa: str):
    """vLLM's CPU attention metadata for a batch, as its builder makes it."""
    from kvreel.connector.vllm_internals import cpu_scheduler_metadata
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return CPUAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), query_start_loc=qsl, max_seq_len=max(seq_lens),
        seq_lens=seq, block_table=table, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), causal=True,
        scheduler_metadata=cpu_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=H * G, num_kv_heads=H, head_dim=D, seq_lens=seq, dtype=torch.bfloat16,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
            kv_cache_dtype="auto"))


def _offload(runtime, cache, meta, row: int, req_id: str, blocks: int) -> None:
    """What the connector does for a long request: its first ``blocks`` blocks go
    to its history, and the block of its newest token names its row."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    if not runtime.caches:
        runtime.register_caches({"model.layers.0.self_attn.attn": cache}, spec, max_batched_tokens=256)
    ids = meta.block_table[row, :blocks].tolist()
    runtime.append_history(req_id, 0, ids)
    newest = int(meta.block_table[row, (int(meta.seq_lens[row]) - 1) // BS])
    runtime.begin_step({**runtime.rows, newest: req_id}, [])


def test_all_history_kept_is_bit_identical_to_vllm_over_its_own_cache(setup):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    impl, runtime = setup
    g = torch.Generator().manual_seed(0)
    # a long request decoding (row 0), a long one in a prefill chunk (row 2), a short one (row 1)
    layer, cache, meta, query = _batch([10 * BS + 5, 3 * BS + 1, 12 * BS], [1, 1, 70], 64, g)
    want = torch.zeros(query.shape, dtype=torch.bfloat16)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, cache, meta, want)
    _offload(runtime, cache, meta, 0, "long-decode", blocks=9)
    _offload(runtime, cache, meta, 2, "long-prefill", blocks=7)
    for _ in range(2):                    # a second step reuses the working sets
        got = torch.zeros(query.shape, dtype=torch.bfloat16)
        impl.forward(layer, query, None, None, cache, meta, got)
        assert torch.equal(got, want)
    # the offloaded pages are gone from vLLM's cache (freed and reused): attention must not read them
    for row, n in ((0, 9), (2, 7)):
        cache[meta.block_table[row, :n].long()] = 7
    got = torch.zeros(query.shape, dtype=torch.bfloat16)
    impl.forward(layer, query, None, None, cache, meta, got)
    assert torch.equal(got, want)
    assert runtime.take_stats().data["retrieval_steps|exact"] == 6


def test_more_resident_blocks_than_a_slot_holds_is_still_exact(setup):
    """A long request can arrive with most of its history still in vLLM's cache
    (a prefix-cache hit kvreel does not hold yet): more resident blocks than its
    working-set slot has room for beside the history. It is attended to from a
    scratch buffer, exactly (the soak found this as a crash)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    impl, runtime = setup
    g = torch.Generator().manual_seed(2)
    layer, cache, meta, query = _batch([70 * BS + 9, 3 * BS + 1], [1, 1], 80, g)
    want = torch.zeros(query.shape, dtype=torch.bfloat16)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, cache, meta, want)
    _offload(runtime, cache, meta, 0, "resumed", blocks=3)
    assert 3 + (71 - 3) > runtime.slot_pages                   # the case: the slot cannot hold them
    cache[meta.block_table[0, :3].long()] = 7                   # the history is read from kvreel, not from here
    got = torch.zeros(query.shape, dtype=torch.bfloat16)
    impl.forward(layer, query, None, None, cache, meta, got)
    assert torch.equal(got, want)


def test_each_step_finds_its_own_long_rows(setup):
    """Which rows are long is found anew every step, even when the step's metadata
    object is where the last step's was (CPython reuses the address of a freed
    object; the soak crashed on a stale answer, and a stale answer that does not
    crash replaces a short request's output)."""
    import dataclasses

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    impl, runtime = setup
    g = torch.Generator().manual_seed(3)
    layer, cache, meta, query = _batch([10 * BS + 5, 3 * BS + 1], [1, 1], 64, g)
    _offload(runtime, cache, meta, 0, "long", blocks=9)
    impl.forward(layer, query, None, None, cache, meta, torch.zeros(query.shape, dtype=torch.bfloat16))
    # the next step: the same two requests in the other order, in the same object
    swapped = _metadata(meta.seq_lens.flip(0).tolist(), [1, 1], meta.block_table.flip(0).contiguous(), layer.isa)
    query = query.flip(0).contiguous()
    want = torch.zeros(query.shape, dtype=torch.bfloat16)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, cache, swapped, want)
    for f in dataclasses.fields(meta):
        setattr(meta, f.name, getattr(swapped, f.name))
    runtime.begin_step(dict(runtime.rows), [])
    got = torch.zeros(query.shape, dtype=torch.bfloat16)
    impl.forward(layer, query, None, None, cache, meta, got)
    assert torch.equal(got, want)


def test_each_step_attends_to_what_its_own_queries_select(setup):
    """With a budget below the history, every decoding step scores the history
    with its own queries and attends to exactly the sink block, the whole blocks
    that hold most of its rows' attention (taken until every row holds alpha of
    it) and the resident blocks; a query that points at one key gets its block."""
    import dataclasses

    from kvreel.connector.retrieval.page_packing import PagePacking
    impl, runtime = setup
    g = torch.Generator().manual_seed(1)
    layer, cache, meta, query = _batch([16 * BS + 3], [1], 40, g)
    _offload(runtime, cache, meta, 0, "r", blocks=14)
    runtime.cfg = dataclasses.replace(runtime.cfg, retrieval_alpha=0.9, retrieval_budget_share=0.5)
    hist = runtime.histories["r"]
    assert not runtime.clusters_for(hist)                    # too short for the DRE: every token is scored
    assert runtime.kept_tokens(hist.num_blocks) == 6 * BS
    pages = cache.view(cache.shape[0], H, 2 * BS, D)
    keys, _ = PagePacking(BS, D, torch.bfloat16, layer.isa).unpack(pages[meta.block_table[0].long()])
    for needle in (3 * BS + 7, 11 * BS + 30, 6 * BS):          # the history token each step's query points at
        q = torch.randn(query.shape, generator=g).bfloat16()
        q[0, :G] = (keys[needle, 0] * 8).bfloat16()              # head 0's query rows
        ws = _check_attends(impl, layer, cache, meta, q, "r")
        orders, need = [], 1
        for h in range(H):                                       # the blocks' attention mass, per row
            share = torch.softmax(q[0, h * G:(h + 1) * G].float() @ keys[BS:14 * BS, h].float().T * D ** -0.5, -1)
            mass = share.view(G, 13, BS).sum(-1)
            order = mass.amax(0).argsort(descending=True)
            taken = mass[:, order].cumsum(-1) - mass[:, order]
            need = max(need, int((taken < 0.9 - 1e-6).sum(-1).max()))
            orders.append(order + 1)
        for h in range(H):
            held = ws.held[h, :ws.m * BS:BS] // BS
            assert held.tolist() == [0] + orders[h][:min(6, need)].tolist()
        assert needle in ws.held[0, :ws.m * BS].tolist()
    assert runtime.take_stats().data["retrieval_steps|selected"] == 3


@pytest.mark.parametrize("one_group_per_call", [False, True])
def test_a_prefill_chunk_attends_in_groups_each_to_what_its_own_rows_select(setup, monkeypatch, one_group_per_call):
    """A long request's prefill chunk is attended to in groups of
    ``KVREEL_RETRIEVAL_ROWS_PER_SET`` rows, each with the history its own
    queries select: groups asking for different needles each get theirs, and
    every row's output is attention over its group's working set, then the
    resident tokens up to its own position; also where the scratch bound
    leaves room for one group per kernel call."""
    import dataclasses

    from kvreel.connector.retrieval import attention_backend
    from kvreel.connector.retrieval.page_packing import PagePacking
    if one_group_per_call:
        monkeypatch.setattr(attention_backend, "GROUP_SCRATCH_BYTES", 1)
    impl, runtime = setup
    g = torch.Generator().manual_seed(11)
    rows, per_set = 70, 32
    layer, cache, meta, query = _batch([20 * BS + 3], [rows], 40, g)
    _offload(runtime, cache, meta, 0, "r", blocks=14)
    runtime.cfg = dataclasses.replace(runtime.cfg, retrieval_alpha=0.9, retrieval_budget_share=0.25,
                                      retrieval_rows_per_set=per_set, retrieval_prefill_select="always")
    pages = cache.view(cache.shape[0], H, 2 * BS, D)
    keys, values = PagePacking(BS, D, torch.bfloat16, layer.isa).unpack(pages[meta.block_table[0].long()])
    needles = (3 * BS + 7, 11 * BS + 30, 6 * BS + 1)             # one per group of rows
    for i, needle in enumerate(needles):
        query[per_set * i:per_set * (i + 1), :G] = (keys[needle, 0] * 8).bfloat16()
    held = []
    choose_in_groups = runtime.choose_in_groups

    def recording(*args):
        chosen = choose_in_groups(*args)
        held.extend(chosen)
        return chosen
    monkeypatch.setattr(runtime, "choose_in_groups", recording)
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    impl.forward(layer, query, None, None, cache, meta, out)
    assert len(held) == 3 and all(h.shape[1] <= 4 * BS for h in held)
    first_position = int(meta.seq_lens[0]) - rows
    for i, needle in enumerate(needles):
        assert needle in held[i][0].tolist()
        for row in range(per_set * i, min(per_set * (i + 1), rows)):
            for h in range(H):
                tokens = torch.cat([held[i][h], torch.arange(14 * BS, first_position + row + 1)])
                k, v = keys[tokens, h].float(), values[tokens, h].float()
                w = torch.softmax(query[row, h * G:(h + 1) * G].float() @ k.T * D ** -0.5, dim=-1)
                assert torch.allclose(out[row, h * G:(h + 1) * G].float(), w @ v, atol=2e-2, rtol=2e-2)
    assert runtime.take_stats().data["retrieval_steps|selected"] == 3


def test_a_prefill_chunk_over_a_history_too_short_to_narrow_attends_to_all_of_it(setup):
    """By default a prefill chunk selects only from a history that is narrowed
    first; over a shorter one it attends to every history token, from kvreel's
    copy (vLLM's pages are gone): the output vLLM computes over its own cache,
    bit for bit, while a decoding row of the same request still selects."""
    import dataclasses

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    impl, runtime = setup
    g = torch.Generator().manual_seed(12)
    layer, cache, meta, query = _batch([20 * BS + 3], [70], 40, g)
    want = torch.zeros(query.shape, dtype=torch.bfloat16)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, cache, meta, want)
    _offload(runtime, cache, meta, 0, "r", blocks=14)
    runtime.cfg = dataclasses.replace(runtime.cfg, retrieval_alpha=0.9, retrieval_budget_share=0.25,
                                      retrieval_rows_per_set=32)
    assert not impl._chunk_selects(runtime.histories["r"])
    cache[meta.block_table[0, :14].long()] = 7
    got = torch.zeros(query.shape, dtype=torch.bfloat16)
    impl.forward(layer, query, None, None, cache, meta, got)
    assert torch.equal(got, want)
    stats = runtime.take_stats().data
    assert stats["retrieval_steps|whole"] == 1 and "retrieval_steps|selected" not in stats
    assert stats["retrieval_kept_blocks"] == stats["retrieval_history_blocks"] == 14
    runtime.cfg = dataclasses.replace(runtime.cfg, retrieval_prefill_select="always")
    assert impl._chunk_selects(runtime.histories["r"])
    impl.forward(layer, query, None, None, cache, meta, got)
    assert not torch.equal(got, want) and runtime.take_stats().data["retrieval_steps|selected"] == 3


def test_a_new_choice_replaces_the_working_set_in_its_order(setup):
    """Each choice is written whole, in its order (over whatever the last one
    left); a history attended in order again is written back in token order."""
    from kvreel.connector.retrieval.scoring import block_tokens
    from kvreel.connector.retrieval.page_packing import PagePacking
    impl, runtime = setup
    g = torch.Generator().manual_seed(5)
    layer, cache, meta, query = _batch([16 * BS + 3], [1], 40, g)
    _offload(runtime, cache, meta, 0, "r", blocks=14)
    lh = runtime.histories["r"].layers[0]
    runtime.working_set("r", 0, query[0].view(H, G, D))          # a first working set (all: exact)
    ws = runtime.working["r", 0]
    unpack = PagePacking(BS, D, torch.bfloat16, layer.isa).unpack
    pages = cache.view(cache.shape[0], H, 2 * BS, D)[meta.block_table[0, :14].long()]
    keys, values = unpack(pages)
    for n_pages in (5, 7, 3):                                    # a choice, a larger one, a smaller one
        want = torch.stack([torch.randperm(14 * BS, generator=g)[:n_pages * BS] for _ in range(H)])
        ws.hold(lh, want)
        assert ws.m == n_pages and torch.equal(ws.held[:, :n_pages * BS], want)
        assert bool((ws.held[:, n_pages * BS:] == -1).all())
        k, v = unpack(ws.buffer[:n_pages])                     # [n_pages bs, H, D], page position order
        for h in range(H):
            assert torch.equal(k[:, h], keys[want[h], h]) and torch.equal(v[:, h], values[want[h], h])
    blocks = torch.stack([torch.randperm(13, generator=g)[:4] + 1 for _ in range(H)])
    ws.hold_blocks(lh, blocks)                                   # whole blocks, per head: page copies
    assert ws.m == 4 and bool((ws.held[:, 4 * BS:] == -1).all())
    for h in range(H):
        assert torch.equal(ws.buffer[:4, h], pages[blocks[h], h])
        assert torch.equal(ws.held[h, :4 * BS], block_tokens(blocks, BS)[h])
    ws.hold_in_order(lh)
    assert ws.m == 14 and torch.equal(ws.buffer[:14], pages[:14])


def test_values_are_read_from_the_pages_as_vllm_packed_them(setup):
    """The history keeps vLLM's pages, not its values: a token's value read from
    them (as rows, or through the packing's permutation, which any layout
    takes) is the value vLLM was given."""
    impl, runtime = setup
    g = torch.Generator().manual_seed(6)
    layer, cache, meta, query = _batch([16 * BS + 3], [1], 40, g)
    _offload(runtime, cache, meta, 0, "r", blocks=14)
    lh = runtime.histories["r"].layers[0]
    _, values = lh.packing.unpack(cache.view(cache.shape[0], H, 2 * BS, D)[meta.block_table[0, :14].long()])
    tokens = torch.stack([torch.randperm(14 * BS, generator=g)[:100] for _ in range(H)])
    from kvreel.connector.retrieval.page_packing import PagePacking
    through_permutation = PagePacking(BS, D, torch.bfloat16, layer.isa)
    through_permutation.values_in_rows = False             # the general path, whatever this ISA stores
    for packing in (lh.packing, through_permutation):
        got = packing.values_at(lh.pages, tokens)
        assert all(torch.equal(got[:, h], values[tokens[h], h]) for h in range(H))


def _check_attends(impl, layer, cache, meta, query, req_id):
    """Runs the layer; its output must be float32 attention over exactly: the
    history tokens the working set holds for each head, then the resident
    blocks 14-16. The working set."""
    from kvreel.connector.retrieval.page_packing import PagePacking
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    impl.forward(layer, query, None, None, cache, meta, out)
    ws = impl.runtime.working[req_id, 0]
    pages = cache.view(cache.shape[0], H, 2 * BS, D)
    k_all, v_all = PagePacking(BS, D, torch.bfloat16, layer.isa).unpack(pages[meta.block_table[0].long()])
    end = int(meta.seq_lens[0])
    for h in range(H):
        tokens = torch.cat([ws.held[h, :ws.m * BS], torch.arange(14 * BS, end)])
        k, v = k_all[tokens, h].float(), v_all[tokens, h].float()
        q = query[0, h * G:(h + 1) * G].float()
        w = torch.softmax(q @ k.T * D ** -0.5, dim=-1)
        assert torch.allclose(out[0, h * G:(h + 1) * G].float(), w @ v, atol=2e-2, rtol=2e-2)
    return ws


def _a_query_for_one_key(runtime, seed: int, **settings):
    """Request "r" with 14 of its 17 blocks in its history, the runtime at alpha
    0.9 and a quarter of the history (plus ``settings``), and a decoding query
    whose first KV head's rows point at one key (token 9 bs + 4)."""
    import dataclasses

    from kvreel.connector.retrieval.page_packing import PagePacking
    g = torch.Generator().manual_seed(seed)
    layer, cache, meta, query = _batch([16 * BS + 3], [1], 40, g)
    _offload(runtime, cache, meta, 0, "r", blocks=14)
    runtime.cfg = dataclasses.replace(runtime.cfg, retrieval_alpha=0.9, retrieval_budget_share=0.25, **settings)
    pages = cache.view(cache.shape[0], H, 2 * BS, D)
    keys, _ = PagePacking(BS, D, torch.bfloat16, layer.isa).unpack(pages[meta.block_table[0].long()])
    q = torch.randn(query.shape, generator=g).bfloat16()
    q[0, :G] = (keys[9 * BS + 4, 0] * 8).bfloat16()
    return layer, cache, meta, q


def test_a_long_history_is_narrowed_by_the_dres_clusters(setup):
    """Past ``KVREEL_RETRIEVAL_CANDIDATES`` x the budget, only the tokens of the
    clusters the queries rank best are scored: the DRE (a process the runtime
    starts) labels the history, the labels are applied on the attention
    thread, and a query that points at one key still gets its token."""
    import time

    impl, runtime = setup
    layer, cache, meta, q = _a_query_for_one_key(runtime, 7, retrieval_candidates=2, retrieval_decode_candidates=0)
    hist = runtime.histories["r"]
    lh = hist.layers[0]
    assert runtime.clusters_for(hist) and runtime.kept_tokens(hist.num_blocks) == 3 * BS
    _check_attends(impl, layer, cache, meta, q, "r")          # asks the DRE to cluster: nothing labelled yet
    assert 9 * BS + 4 in runtime.working["r", 0].held[0].tolist()
    deadline = time.monotonic() + 60
    while bool((lh.labels < 0).any()):
        assert time.monotonic() < deadline, "the DRE's labels did not come"
        time.sleep(0.05)
        runtime.dre.take_labels(runtime.histories)
    assert int(lh.counts.sum()) == H * 13 * BS
    # the DRE's tables (a child process on this host) are charged beside the histories
    from kvreel.dre.resv import HASH_BITS, cluster_keys, hyperplanes
    planes = hyperplanes(D, HASH_BITS, seed=1)
    tables = sum(cluster_keys(k, planes, 0).nbytes for k in lh.dre_keys())
    assert runtime.dre.table_bytes() == tables > 0
    assert runtime.reserved_bytes() == hist.reserved_bytes + tables
    assert runtime.memory()["dre_tables"] == tables
    narrowed = lh.candidates(q[0].float().view(H, G, D), 6 * BS)
    assert narrowed.shape == (H, 6 * BS)
    ws = _check_attends(impl, layer, cache, meta, q, "r")
    for h in range(H):
        chosen = ws.held[h, BS:ws.m * BS]
        assert bool(torch.isin(chosen, narrowed[h]).all())    # only candidates were scored
    assert 9 * BS + 4 in ws.held[0].tolist()
    stats = runtime.take_stats().data
    assert stats["retrieval_steps|selected"] == 2 and stats["dre_tables|clustered"] == 1
    runtime.drop("r")
    assert runtime.dre.table_bytes() == 0 == runtime.reserved_bytes()


def test_the_dre_clusters_only_histories_whose_requests_can_grow_to_be_narrowed(setup):
    """A history is sent to the DRE before it is long enough to be narrowed (so its
    clusters are ready when it is twice as long), but not where its request can
    never grow that long (its prompt and longest answer, as the scheduler says):
    a request that is never narrowed never costs the DRE's time and memory."""
    from kvreel.connector.retrieval.selection import narrows
    impl, runtime = setup
    _a_query_for_one_key(runtime, 7, retrieval_candidates=3, retrieval_budget_tokens=128)
    hist = runtime.histories["r"]
    assert not narrows(3, runtime.kept_tokens(hist.num_blocks), (hist.num_blocks - 1) * BS)    # not yet narrowed
    assert runtime.clusters_for(hist)                          # how far it grows is unknown: clustered ahead
    for reach, clustered in ((17, False), (40, True)):
        runtime.drop("r")
        runtime.add_history("r", 0, [runtime.caches[0][torch.arange(1, 15)]], reach_blocks=reach)
        assert runtime.clusters_for(runtime.histories["r"]) is clustered
    runtime.drop("r")


def test_a_decoding_step_holds_whole_blocks_narrowed_by_their_key_bounds(setup):
    """Past ``KVREEL_RETRIEVAL_DECODE_CANDIDATES`` x the budget, a decoding step
    scores only the tokens of the blocks its own queries rank best by their keys'
    bounds (no DRE is asked for) and holds whole blocks, the sink's first, copied
    as vLLM packed them; a query that points at one key still gets its block, and
    a prefill chunk of the same request is not narrowed so."""
    from kvreel.connector.retrieval.scoring import block_tokens
    impl, runtime = setup
    layer, cache, meta, q = _a_query_for_one_key(runtime, 11, retrieval_decode_candidates=2)
    hist = runtime.histories["r"]
    lh = hist.layers[0]
    count = runtime.kept_tokens(hist.num_blocks)
    assert count == 3 * BS and not runtime.clusters_for(hist)      # 14 blocks: chunks score every token
    narrowed = lh.best_blocks(q[0].float().view(H, G, D), 6)
    assert narrowed.shape == (H, 6)
    ws = _check_attends(impl, layer, cache, meta, q, "r")
    pages = cache.view(cache.shape[0], H, 2 * BS, D)[meta.block_table[0].long()]
    held = ws.held[:, :ws.m * BS:BS] // BS                          # [H, m]: the block at each page
    assert 2 <= ws.m <= 4 and bool((held[:, 0] == 0).all())
    for h in range(H):
        assert bool(torch.isin(held[h, 1:], narrowed[h]).all())     # only candidates were scored
        assert torch.equal(ws.held[h, :ws.m * BS], block_tokens(held, BS)[h])
        assert torch.equal(ws.buffer[:ws.m, h], pages[held[h], h])
    assert 9 in held[0].tolist()
    assert not runtime.dre.holds("r", 0)
    every = runtime.choose_in_groups("r", 0, q[0].float().view(H, G, D), G)[0]
    candidates = block_tokens(narrowed, BS)
    assert not all(bool(torch.isin(every[h, BS:], candidates[h]).all()) for h in range(H))
