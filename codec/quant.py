"""Quantizers: KV values <-> 8-bit samples the video codec can carry.

* ``none``: bit-exact. 16-bit values become two byte planes (low, high) and
  32-bit values four; nothing is lost.
* ``int8``: per (layer, K/V, head, channel) min-max over the chunk's tokens, in
  the spirit of CacheGen's per-channel ranges; error is reported by
  ``quant_error``.
"""

from __future__ import annotations

import torch

QUANTS = ("none", "int8")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def byte_planes(dtype: torch.dtype, quant: str) -> int:
    return dtype.itemsize if quant == "none" else 1


def to_samples(kv: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[L, 2, T, H, D] -> (uint8 samples [L, 2, B, T, H, D], int8 params [L, 2, 2, H, D] float32 or None)."""
    if quant == "none":
        raw = kv.contiguous().view(torch.uint8).view(*kv.shape, kv.dtype.itemsize)
        return raw.movedim(-1, 2).contiguous(), None
    if quant == "int8":
        x = kv.float()
        lo = x.amin(dim=2)
        hi = x.amax(dim=2)
        scale = ((hi - lo) / 255.0).clamp_min(1e-12)
        q = torch.round((x - lo.unsqueeze(2)) / scale.unsqueeze(2)).clamp_(0, 255).to(torch.uint8)
        return q.unsqueeze(2), torch.stack([lo, scale], dim=2)
    raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")


def restore_tokens(out: torch.Tensor, layer: int, kv: int, byte: int, tokens: torch.Tensor,
                   values: torch.Tensor, quant: str, params: torch.Tensor | None) -> None:
    """Write decoded samples ``values`` [n, H, D] (uint8) of (layer, kv, byte plane)
    into ``out`` [L, 2, T, H, D] at token positions ``tokens``."""
    if quant == "none":
        dst = out[layer, kv].view(torch.uint8).view(*out.shape[2:], out.dtype.itemsize)
        dst[tokens, ..., byte] = values.to(dst.device)
    else:
        lo, scale = params[layer, kv, 0], params[layer, kv, 1]
        deq = values.float() * scale + lo
        out[layer, kv, tokens] = deq.to(out.dtype).to(out.device)


def quant_error(kv: torch.Tensor, restored: torch.Tensor) -> dict[str, float]:
    a, b = kv.float(), restored.float()
    return {"rel_l2": float((a - b).norm() / a.norm().clamp_min(1e-30)), "max_abs": float((a - b).abs().max())}
