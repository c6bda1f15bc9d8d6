"""kvreel's tiers in vLLM's own KV cache events, published by vLLM's ZMQ publisher
and decoded with vLLM's classes: the blocks kvreel announces are the engine's
own block hashes with the same tokens and parents, so a router that matches a
prompt against them finds what a request will be served from."""

from __future__ import annotations

import pytest

from conftest import run_scenario, tokens

pytestmark = pytest.mark.vllm

BS = 32                      # the scenarios' block size
P, OTHER = tokens(600, 1), tokens(600, 7)


def _blocks(events: list[dict], medium: str, kind: str = "BlockStored") -> dict:
    """hash -> (parent hash, the block's tokens) of every block announced in ``medium``."""
    out = {}
    for ev in events:
        if ev["kind"] != kind or ev["medium"] != medium:
            continue
        parent = ev.get("parent_block_hash")
        for i, h in enumerate(ev["block_hashes"]):
            out[h] = (parent, ev.get("token_ids", [])[i * BS:(i + 1) * BS])
            parent = h
    return out


def test_tiers_are_published_as_vllm_kv_events(tiny_model, tmp_path):
    # a 32 KiB block: the host tier holds one 18-block prompt, the disk tier both
    cfg = {"cpu_bytes": "700KiB", "disk_dir": str(tmp_path / "disk")}
    out = run_scenario({"model": tiny_model, "kvreel": cfg, "kv_events": f"ipc://{tmp_path / 'events'}",
                        "phases": [{"prompts": [P]}, {"prompts": [OTHER]},
                                   {"before": "reset_prefix_cache", "prompts": [P]}]})
    first, second, third = out["events"]

    gpu = _blocks(first, "GPU")
    host, disk = _blocks(first, "CPU"), _blocks(first, "STORAGE")
    assert len(host) == 600 // BS
    assert host == disk == {h: gpu[h] for h in host}          # the engine's hashes, tokens and parents
    assert host[next(iter(host))][0] is None                  # the prefix starts at the first block
    assert all(ev["locality"] == "LOCAL" for ev in first if ev["medium"] in ("CPU", "STORAGE"))

    evicted = set(_blocks(second, "CPU", "BlockRemoved"))
    assert evicted and evicted <= set(host)                   # P left host memory for OTHER ...
    assert not _blocks(second, "STORAGE", "BlockRemoved")     # ... and stays on disk
    assert set(_blocks(second, "CPU")) == set(_blocks(second, "GPU"))

    assert out["phases"][2][0]["num_cached_tokens"] == len(host) * BS   # what was announced is served
    assert _blocks(third, "CPU") == {h: gpu[h] for h in evicted}        # loaded from disk, back in host memory
