"""A tiny Gemma-3-style hybrid model for the hybrid-KV-cache tests, built like
the demo's Llama (random weights, no model hub)."""

from __future__ import annotations

from pathlib import Path

from kvreel.cli.tiny_model import build_random_model


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
    spec = dict(
        arch="gemma3_text", layer_types=list(layer_types), sliding_window=sliding_window, hidden_size=hidden_size,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, dtype=dtype, seed=seed,
    )

    def make(tokenizer, common):
        # untied: tied random embeddings predict the input token, over and over
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        return Gemma3ForCausalLM(Gemma3TextConfig(
            **common, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
            sliding_window=sliding_window, head_dim=head_dim, pad_token_id=tokenizer.eos_token_id))
    return build_random_model(out_dir, spec, make)
