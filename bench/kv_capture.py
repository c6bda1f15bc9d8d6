"""Capture the KV cache of a trained model over real text (for codec and
retrieval benchmarks): [layers, 2, tokens, kv_heads, head_dim], post-RoPE keys,
exactly what vLLM's paged cache holds.

    python bench/kv_capture.py --model ../shared/models/tinycode-16m-4k --tokens 4096 --out bench/data/kv.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import python_source_corpus, yarn_overrides  # noqa: E402


def capture(model_path: str, tokens: int, offset: int = 0, return_qkv: bool = False, yarn: float = 0):
    """``yarn``: the model's RoPE stretched by that YaRN factor, as vLLM serves it
    with ``yarn_overrides``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    config = AutoConfig.from_pretrained(model_path)
    for name, value in (yarn_overrides(model_path, yarn) if yarn else {}).items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.bfloat16).eval()
    ids = tok(python_source_corpus(tokens * 8 + offset * 8))["input_ids"][offset:offset + tokens]
    assert len(ids) == tokens, (len(ids), tokens)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    layers = []
    for layer in cache.layers:
        layers.append(torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)]))
    return torch.stack(layers).contiguous(), ids       # [L, 2, T, H, D]


def capture_qkv(model_path: str, tokens: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-RoPE queries [L, Hq, T, D] and keys/values [L, Hkv, T, D] over
    ``tokens`` tokens of Python source, as attention sees them (float32)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok(python_source_corpus(tokens * 8 + offset * 8))["input_ids"][offset:offset + tokens]
    return capture_qkv_ids(model_path, ids)


def capture_qkv_ids(model_path: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same over the given token ids."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16,
                                                 attn_implementation="eager").eval()
    seen: list[tuple[torch.Tensor, ...]] = []
    original = llama.eager_attention_forward

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((query[0].float(), key[0].float(), value[0].float()))
        return original(module, query, key, value, *args, **kwargs)
    llama.eager_attention_forward = recording
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        llama.eager_attention_forward = original
    q, k, v = (torch.stack(t) for t in zip(*seen))
    return q, k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    kv, ids = capture(a.model, a.tokens)
    torch.save({"kv": kv, "token_ids": ids, "model": Path(a.model).name}, a.out)
    print(a.out, tuple(kv.shape), kv.dtype)


if __name__ == "__main__":
    main()
