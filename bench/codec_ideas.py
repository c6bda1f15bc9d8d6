"""What makes real KV predictable? Each idea's effect on size (zstd -19 and
lossless HEVC, both over raw 16-bit KV) and its error, on a trained model's KV.

    python bench/codec_ideas.py --model ../shared/models/tinycode-16m-4k --tokens 4096

Ideas: keys coded before RoPE (re-rotated on restore); CacheGen-style deltas
against anchor tokens; coarser bins for deeper layers; channels reordered by
similarity inside each head. Per-channel min-max quantization throughout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from codec_compression import entropy_bits, video_bytes  # noqa: E402
from common import save  # noqa: E402

MEASURES = ("codec",)  # the package paths its figures measure (bench/report.py)


def rope_tables(T: int, D: int, theta: float):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def unrope(k, cos, sin):   # k: [T, H, D]
    return k * cos[:, None] - rotate_half(k) * sin[:, None]


def rope(k, cos, sin):
    return k * cos[:, None] + rotate_half(k) * sin[:, None]


def quant(x: torch.Tensor, bits: int, dim: int):
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(1e-12)
    q = torch.round((x - lo) / scale).clamp_(0, levels)
    return q.to(torch.uint8), q * scale + lo


def measure(name, samples: torch.Tensor, restored: torch.Tensor, kv: torch.Tensor, resolution: int, extra=None):
    """samples: uint8 [L, 2, 1, T, H, D]; restored: float KV the decoder would give back."""
    import zstandard
    raw16 = kv.numel() * 2
    flat = samples.contiguous().numpy().tobytes()
    x = kv.float()
    err = {"rel_l2": float((restored.float() - x).norm() / x.norm()),
           "max_abs": float((restored.float() - x).abs().max())}
    row = {"idea": name, "error": err,
           "zstd19_ratio": raw16 / len(zstandard.ZstdCompressor(level=19).compress(flat)),
           "hevc_ratio": raw16 / video_bytes(samples, "naive", None, resolution, "medium"),
           "entropy_bits": entropy_bits(samples.numpy()), **(extra or {})}
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, default=str),
          flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--resolution", type=int, default=512)
    a = ap.parse_args()
    from kv_capture import capture
    from transformers import AutoConfig
    kv, _ = capture(a.model, a.tokens)
    cfg = AutoConfig.from_pretrained(a.model)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    L, _, T, H, D = kv.shape
    cos, sin = rope_tables(T, D, theta)
    x = kv.float()
    rows = []
    for bits in (8, 4):
        # baseline: per-channel min-max over tokens
        q, r = quant(x, bits, 2)
        rows.append(measure(f"{bits}-bit baseline (post-RoPE keys)", q.unsqueeze(2), r, kv, a.resolution, {"bits": bits}))
        # keys before RoPE
        pre = x.clone()
        for l in range(L):
            pre[l, 0] = unrope(x[l, 0], cos, sin)
        q, r = quant(pre, bits, 2)
        for l in range(L):
            r[l, 0] = rope(r[l, 0], cos, sin)
        rows.append(measure(f"{bits}-bit keys before RoPE", q.unsqueeze(2), r, kv, a.resolution, {"bits": bits}))
        # anchor deltas (CacheGen): groups of 16 tokens, anchor at full bits, deltas at full bits too
        G = 16
        anchors = x[:, :, ::G]
        idx = torch.arange(T) // G * G
        delta = x - x[:, :, idx]
        qa, ra = quant(anchors, bits, 2)
        qd, rd = quant(delta, bits, 2)
        restored = rd + ra.repeat_interleave(G, dim=2)[:, :, :T]
        samples = torch.cat([qa, qd], dim=2)
        rows.append(measure(f"{bits}-bit anchor deltas (groups of {G})", samples.unsqueeze(2), restored, kv,
                            a.resolution, {"bits": bits}))
        # coarser bins for the deeper half of the layers
        r_all = torch.empty_like(x)
        q_all = torch.empty(x.shape, dtype=torch.uint8)
        for l in range(L):
            b = bits if l < L // 2 else max(2, bits - 2)
            q_all[l], r_all[l] = quant(x[l], b, 1)
        avg_bits = (bits * (L // 2) + max(2, bits - 2) * (L - L // 2)) / L
        rows.append(measure(f"{bits}/{max(2, bits - 2)}-bit shallow/deep layers", q_all.unsqueeze(2), r_all, kv,
                            a.resolution, {"bits": avg_bits}))
        # channels reordered by their mean inside each head (breaks the "keep element order" rule)
        order = x.mean(2, keepdim=True).argsort(-1)
        xs = torch.gather(x, -1, order.expand_as(x))
        q, r = quant(xs, bits, 2)
        back = torch.empty_like(r).scatter_(-1, order.expand_as(r), r)
        rows.append(measure(f"{bits}-bit channels sorted by mean", q.unsqueeze(2), back, kv, a.resolution,
                            {"bits": bits}))
    save("codec_ideas", {"model": a.model, "tokens": T, "shape": list(kv.shape), "rope_theta": theta, "rows": rows})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["error"]["rel_l2"], r["hevc_ratio"], label=r["idea"], marker="o" if r["bits"] >= 6 else "s")
    ax.set_xlabel("relative L2 error of restored KV")
    ax.set_ylabel("lossless HEVC ratio over 16-bit KV")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(f"codec ideas on {Path(a.model).name} KV, {T} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(__file__).parent / "results" / "codec_ideas.png", dpi=120)


if __name__ == "__main__":
    main()
