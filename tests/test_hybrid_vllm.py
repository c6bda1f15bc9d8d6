"""Hybrid models (sliding-window and full-attention layers) with kvreel attached:
vLLM's hybrid KV cache manager stays on, so sliding-window layers keep only
their window, and kvreel stores and restores each KV cache group exactly.

Outputs are compared with plain vLLM's bit for bit (the engine core runs in the
scenario's process, so a phase's prompts share every step as in plain vLLM's)."""

from __future__ import annotations

import pytest

from conftest import run_scenario, tokens
from test_integrity_vllm import _corrupt_payloads

pytestmark = pytest.mark.vllm

P, Q = tokens(700, 1), tokens(300, 2)
LONG = tokens(1500, 3)
ENGINE = {"num_blocks": 200, "max_model_len": 2048, "max_num_batched_tokens": 128}      # chunked prefill
HMA_OFF = "Hybrid KV cache manager is disabled"


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    """A Gemma-3-style model: two sliding-window (64 tokens) and two full-attention layers."""
    from hybrid_model import build_tiny_gemma3
    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


def test_hybrid_model_keeps_its_window_and_reuses_exactly(hybrid_model, tmp_path):
    """A hybrid model's loads are asynchronous (vLLM maps their failures by
    request), so a reused prompt runs alone in its phase: its batch is then
    what it is in plain vLLM, whenever its load completes."""
    disk = str(tmp_path / "disk")
    base = run_scenario({"model": hybrid_model, **ENGINE, "phases": [
        {"prompts": [P, Q], "max_tokens": 16},
        {"prompts": [P]},                                          # from vLLM's own prefix cache
        {"before": "reset_prefix_cache", "prompts": [P]},          # computed
        {"prompts": [LONG]}]})
    off = run_scenario({"model": hybrid_model, **ENGINE, "disable_hybrid_kv_cache_manager": True,
                        "phases": [{"prompts": [LONG]}]})
    reel = run_scenario({"model": hybrid_model, "kvreel": {"cpu_bytes": "64MiB", "disk_dir": disk}, **ENGINE,
                         "phases": [
        {"prompts": [P, Q], "max_tokens": 16},
        {"before": "reset_prefix_cache", "prompts": [P]},                    # from kvreel's host tier
        {"before": "restart", "prompts": [P]},                               # from kvreel's disk tier
        {"before": [_corrupt_payloads(disk), "restart"], "prompts": [P]},    # its chunks are damaged
        {"before": "reset_prefix_cache", "prompts": [P]},                    # stored anew from the recompute
        {"prompts": [LONG]}]})
    assert HMA_OFF not in reel["log"]
    assert reel["phases"][0] == base["phases"][0]
    for phase in (1, 2, 4):                  # reused from host memory, from disk, again: bit for bit
        assert reel["phases"][phase] == base["phases"][1]
        assert reel["phases"][phase][0]["num_cached_tokens"] == 672
    # damaged chunks: the request is recomputed whole (vLLM maps a hybrid model's failed
    # loads by request), counted and logged, never a wrong token
    assert reel["phases"][3] == base["phases"][2]
    m = reel["metrics"]
    assert m["vllm:kvreel_corrupt_chunks_total|disk"] >= 1
    assert m["vllm:kvreel_load_error_blocks_total"] >= 8
    assert "payload checksum mismatch" in reel["log"]
    # sliding-window layers held only their window: the KV bytes vLLM holds at the peak are what they
    # are without kvreel (with the hybrid manager off, as vLLM turns it off for connectors without
    # HMA, every layer keeps every block)
    assert reel["peak_kv_bytes"][-1] == base["peak_kv_bytes"][-1] > 0
    assert off["peak_kv_bytes"][0] > 1.5 * base["peak_kv_bytes"][-1]


def test_a_model_with_recurrent_state_is_refused_at_startup():
    """kvreel does not save a Mamba layer's state: such a model is refused with the reason."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, \
        MambaSpec

    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.kvreel_connector import check_kv_cache_groups
    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16, torch.bfloat16))
    config = KVCacheConfig(num_blocks=10, kv_cache_tensors=[
        KVCacheTensor(size=10 * attn.page_size_bytes, layers=["a0"], layer_stride=10 * attn.page_size_bytes,
                      block_stride=attn.page_size_bytes)],
        kv_cache_groups=[KVCacheGroupSpec(["a0"], attn), KVCacheGroupSpec(["m0"], mamba)])
    with pytest.raises(ValueError, match="holds state it does not save"):
        check_kv_cache_groups(config, KVReelConfig.load(env={}))
    two = KVCacheConfig(num_blocks=10, kv_cache_tensors=config.kv_cache_tensors,
                        kv_cache_groups=[KVCacheGroupSpec(["a0"], attn), KVCacheGroupSpec(["a1"], attn)])
    assert check_kv_cache_groups(two, KVReelConfig.load(env={})) == 32
    with pytest.raises(ValueError, match="KVREEL_RETRIEVAL needs a model whose layers share one"):
        check_kv_cache_groups(two, KVReelConfig.load(env={"KVREEL_RETRIEVAL": "resv"}))
    with pytest.raises(ValueError, match="KVREEL_FETCH_MODE=blocking needs a model with one KV cache group"):
        check_kv_cache_groups(two, KVReelConfig.load(env={"KVREEL_FETCH_MODE": "blocking"}))


def test_pages_of_overlaid_groups_are_copied_with_their_own_block_ids():
    """vLLM's hybrid manager overlays the groups' tensors on the same bytes: a
    region is one layer of one group, addressed by that group's block ids, and
    a sliding-window group's NULL_BLOCK positions are neither read nor written."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, \
        SlidingWindowSpec

    from kvreel.connector.worker_side.block_copy import NULL_BLOCK, PagedRegions, layout_of
    blocks, page = 8, 16
    buf = torch.arange(2 * blocks * page, dtype=torch.int16).to(torch.int8)
    tensors = [KVCacheTensor(size=buf.numel(), layers=names, layer_stride=blocks * page, block_stride=page)
               for names in (["s0", "s1"], ["f0", "f1"])]
    kw = dict(block_size=32, num_kv_heads=1, head_size=4, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=tensors, kv_cache_groups=[
        KVCacheGroupSpec(["s0", "s1"], SlidingWindowSpec(**kw, sliding_window=64)),
        KVCacheGroupSpec(["f0", "f1"], FullAttentionSpec(**kw))])
    layer = {name: buf[i * blocks * page:(i + 1) * blocks * page].view(blocks, page)
             for names in (["s0", "s1"], ["f0", "f1"]) for i, name in enumerate(names)}
    pages = PagedRegions(layer, config)
    assert layout_of(config) == (4, page) and pages.group_of == [0, 0, 1, 1]
    host = pages.gather(([1, 2], [5, 6]))
    for r, (name, ids) in enumerate((("s0", [1, 2]), ("s1", [1, 2]), ("f0", [5, 6]), ("f1", [5, 6]))):
        assert torch.equal(host[r].view(torch.int8), layer[name][ids])
    before = buf.clone()
    pages.scatter(host, ([NULL_BLOCK, 3], [4, 7]))
    assert torch.equal(layer["s0"][3], host[0, 1].view(torch.int8))
    assert torch.equal(layer["f1"][4], host[3, 0].view(torch.int8)) and torch.equal(layer["f1"][7], host[3, 1].view(torch.int8))
    changed = {(i // page) % blocks for i in torch.nonzero(buf != before).flatten().tolist()}
    assert changed <= {3, 4, 7}                   # the null block and every other block untouched
    with pytest.raises(ValueError, match="held by every KV cache group"):
        pages.gather(([NULL_BLOCK, 2], [5, 6]))
