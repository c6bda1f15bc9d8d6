"""Build tiny random-weight models (a Llama; a Gemma-3-style hybrid) plus a BPE
tokenizer that vLLM can serve.

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


def _fresh(out: Path, spec: dict) -> bool:
    """True if ``out`` already holds the model ``spec`` describes (builds are idempotent)."""
    marker = out / "kvreel_tiny.json"
    return marker.exists() and json.loads(marker.read_text()) == spec


def _save(out: Path, spec: dict, model, tokenizer) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "kvreel_tiny.json").write_text(json.dumps(spec))
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
    out = Path(out_dir)
    spec = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, dtype=dtype, seed=seed,
    )
    if _fresh(out, spec):
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _train_tokenizer(vocab_size)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    return _save(out, spec, LlamaForCausalLM(config).to(getattr(torch, dtype)), fast)


def build_tiny_gemma3(
    out_dir: str | Path,
    *,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2,
    sliding_window: int = 64,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """A Gemma-3-style text model mixing sliding-window and full-attention layers
    (a hybrid model: vLLM's hybrid KV cache manager gives each kind its own KV
    cache group), random weights, written to ``out_dir`` (idempotent)."""
    out = Path(out_dir)
    spec = dict(
        arch="gemma3_text", layer_types=list(layer_types), sliding_window=sliding_window, hidden_size=hidden_size,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, dtype=dtype, seed=seed,
    )
    if _fresh(out, spec):
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fast = _train_tokenizer(vocab_size)
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        sliding_window=sliding_window,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,    # tied random embeddings predict the input token, over and over
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.eos_token_id,
        torch_dtype=dtype,
    )
    return _save(out, spec, Gemma3ForCausalLM(config).to(getattr(torch, dtype)), fast)


if __name__ == "__main__":
    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else ".kvreel/tiny-llama"))
