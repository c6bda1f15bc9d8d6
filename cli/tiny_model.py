"""Build tiny random-weight models plus a BPE tokenizer that vLLM can serve
(a Llama here; the tests add a Gemma-3-style hybrid).

Model hubs are unreachable on CI and on many operators' build machines, so the
demo, the tests and the exactness benchmarks create their model locally. Random
weights are enough for exactness (bit-identical outputs); quality figures use a
trained model instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CORPUS_MODULES = ("json", "asyncio", "collections", "email", "http", "logging")


def corpus_files() -> list[str]:
    """Python's own standard library: present wherever Python is."""
    stdlib = Path(sys.modules["os"].__file__).parent
    files: list[str] = []
    for name in CORPUS_MODULES:
        target = stdlib / name
        files += sorted(str(p) for p in (target.rglob("*.py") if target.is_dir() else [target.with_suffix(".py")]))
    return [f for f in files if Path(f).exists()]


def build_random_model(out_dir: str | Path, spec: dict, make_model) -> Path:
    """Write ``make_model(tokenizer, common_config_fields)``'s random-weight model
    and a tokenizer to ``out_dir``; nothing to do if it already holds ``spec``'s model."""
    out = Path(out_dir)
    marker = out / "kvreel_tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch

    fast = _train_tokenizer(spec["vocab_size"])
    torch.manual_seed(spec["seed"])
    common = dict(vocab_size=len(fast), hidden_size=spec["hidden_size"], intermediate_size=spec["hidden_size"] * 2,
                  num_attention_heads=spec["num_heads"], num_key_value_heads=spec["num_kv_heads"],
                  max_position_embeddings=spec["max_position_embeddings"], bos_token_id=fast.bos_token_id,
                  eos_token_id=fast.eos_token_id, tie_word_embeddings=False, torch_dtype=spec["dtype"])
    model = make_model(fast, common).to(getattr(torch, spec["dtype"]))
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on Python's standard library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def build_tiny_llama(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """Write config, random weights and tokenizer to ``out_dir`` (idempotent)."""
    spec = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, dtype=dtype, seed=seed,
    )

    def make(tokenizer, common):
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**common, num_hidden_layers=num_layers))
    return build_random_model(out_dir, spec, make)


if __name__ == "__main__":
    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else ".kvreel/tiny-llama"))
