"""The retrieval attention impl on vLLM's real CPU kernels, outside an engine:
a long sequence attends exactly to its sink block, the blocks the DRE kept and
the window (checked against attention computed in float32 over those tokens),
through a block table whose physical blocks are out of order."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

BS, H, G, D = 32, 2, 2, 64


@pytest.fixture
def impl(tiny_model, monkeypatch):
    monkeypatch.delenv("KVREEL_TEST_MODEL_CACHE", raising=False)    # not a kvreel setting
    for k, v in {"KVREEL_RETRIEVAL": "resv", "KVREEL_RETRIEVAL_ALPHA": "0.8", "KVREEL_RETRIEVAL_MIN_TOKENS": "64",
                 "KVREEL_RETRIEVAL_WINDOW": "32", "KVREEL_RETRIEVAL_DEADLINE_MS": "10000"}.items():
        monkeypatch.setenv(k, v)
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from kvreel.connector.retrieval.attention_backend import RetrievalAttentionImpl
    from kvreel.connector.retrieval.retriever import Retriever
    Retriever._instance = None
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=tiny_model))):
        yield RetrievalAttentionImpl(num_heads=H * G, head_size=D, scale=D ** -0.5, num_kv_heads=H,
                                     alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    retriever = Retriever._instance
    if retriever._process is not None:
        retriever._process.stop()
    Retriever._instance = None


def test_long_sequence_attends_to_sink_selected_and_window_blocks_exactly(impl):
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa
    g = torch.Generator().manual_seed(0)
    T, num_blocks = 10 * BS + 1, 16                       # 10 full blocks + the decoded token
    row = torch.tensor([15, 3, 9, 1, 12, 7, 0, 5, 11, 2, 14], dtype=torch.int32)   # logical -> physical
    slots = (row.long()[torch.arange(T) // BS] * BS + torch.arange(T) % BS)
    # keys in 4 directions, half the blocks share the query's: the DRE can tell them apart
    centers = torch.randn(4, H, D, generator=g)
    key = (centers[(torch.arange(T) // BS) % 4] + 0.3 * torch.randn(T, H, D, generator=g)).bfloat16()
    value = torch.randn(T, H, D, generator=g)
    value[(torch.arange(T) // BS) % 4 != 0] += 100         # what the cut drops is large: dropping it shows
    value = value.bfloat16()
    query = (centers[0].repeat_interleave(G, 0) + 0.3 * torch.randn(H * G, D, generator=g)).bfloat16().unsqueeze(0)
    isa = _get_attn_isa(torch.bfloat16, BS, D, "auto")
    layer = SimpleNamespace(isa=isa, layer_name="model.layers.0.self_attn.attn", _k_scale_float=1.0,
                            _v_scale_float=1.0)
    kv_cache = torch.zeros(num_blocks, H, BS, 2 * D, dtype=torch.bfloat16)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)

    seq_lens, qsl = torch.tensor([T], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    block_table = torch.zeros(1, num_blocks, dtype=torch.int32)
    block_table[0, :len(row)] = row
    meta = CPUAttentionMetadata(
        num_actual_tokens=1, max_query_len=1, query_start_loc=qsl, max_seq_len=T, seq_lens=seq_lens,
        block_table=block_table, slot_mapping=slots[-1:], causal=True,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=H * G, num_kv_heads=H, head_dim=D, seq_lens=seq_lens, dtype=torch.bfloat16,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype="auto"))

    cut = impl._retrieval_metadata(layer, query, kv_cache, meta)
    kept_physical = cut.block_table[0, :-(-int(cut.seq_lens[0]) // BS)].tolist()
    kept_logical = [row.tolist().index(b) for b in kept_physical]
    assert kept_logical == sorted(kept_logical)                       # positions stay in order
    assert kept_logical[0] == 0 and kept_logical[-2:] == [9, 10]      # sink block, window + own token
    assert 3 < len(kept_logical) < len(row)                           # some history dropped, some kept
    assert {0, 4, 8} <= set(kept_logical)                             # the query's direction was kept
    assert int(cut.seq_lens[0]) == T - BS * (len(row) - len(kept_logical))

    # a prefill chunk that starts below the threshold attends fully: KV below it stays exact
    # (threshold 200, chunk = positions 171-320: history 1-4 could be cut, but positions 171-199 must not)
    cfg = impl.retriever.cfg
    impl.retriever.cfg = dataclasses.replace(cfg, retrieval_min_tokens=200)
    chunk = torch.tensor([0, 150], dtype=torch.int32)
    prefill = dataclasses.replace(meta, query_start_loc=chunk, num_actual_tokens=150, max_query_len=150)
    assert impl._retrieval_metadata(layer, query.expand(150, -1, -1).contiguous(), kv_cache, prefill) is prefill
    impl.retriever.cfg = cfg

    output = torch.zeros(1, H * G, D, dtype=torch.bfloat16)
    impl.forward(layer, query, key[-1:], value[-1:], kv_cache, meta, output)
    tokens = torch.cat([torch.arange(b * BS, min((b + 1) * BS, T)) for b in kept_logical])
    k = key[tokens].float().repeat_interleave(G, 1)                   # [n, H*G, D]
    v = value[tokens].float().repeat_interleave(G, 1)
    weights = torch.softmax(torch.einsum("hd,nhd->hn", query[0].float(), k) * D ** -0.5, dim=-1)
    want = torch.einsum("hn,nhd->hd", weights, v)
    assert torch.allclose(output[0].float(), want, atol=1e-2, rtol=1e-2)
    full_w = torch.softmax(torch.einsum("hd,nhd->hn", query[0].float(), key.float().repeat_interleave(G, 1))
                           * D ** -0.5, dim=-1)
    full = torch.einsum("hn,nhd->hd", full_w, value.float().repeat_interleave(G, 1))
    assert (want - full).abs().max() > 0.05                           # the cut is visible in the output
