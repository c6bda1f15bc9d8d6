"""Compression of real KV (a trained model over real text) by kvreel's codec
stages vs general-purpose compressors on exactly the same quantized bytes.

    python bench/codec_compression.py --model ../shared/models/tinycode-16m-4k --tokens 4096

Stages (ratios over raw 16-bit KV): quantization alone; + naive video layout
(token rows x channels, 3 layers as planes); + token-sliced inter-frame layout
with a fixed tiling; + searched intra-frame tiling. Baselines: zlib -9, zstd -19
and lzma on the quantized samples. Also the order-0 entropy of the samples and
of their token-to-token deltas, and each quantizer's error.
"""

from __future__ import annotations

import argparse
import lzma
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import save  # noqa: E402

MEASURES = ("codec",)  # the package paths its figures measure (bench/report.py)


def entropy_bits(a: np.ndarray) -> float:
    counts = np.bincount(a.reshape(-1).astype(np.int64))
    p = counts[counts > 0] / a.size
    return float(-(p * np.log2(p)).sum())


def quantize(kv: torch.Tensor, bits: int | None) -> torch.Tensor:
    """uint8 samples [L, 2, B, T, H, D]: byte planes (bits=None) or per-channel min-max."""
    from kvreel.codec.quant import to_samples
    if bits is None:
        return to_samples(kv, "none")[0]
    x = kv.float()
    lo, hi = x.amin(2, keepdim=True), x.amax(2, keepdim=True)
    levels = (1 << bits) - 1
    q = torch.round((x - lo) / ((hi - lo) / levels).clamp_min(1e-12)).clamp_(0, levels).to(torch.uint8)
    return q.unsqueeze(2)


def dequant_error(kv, bits):
    x = kv.float()
    lo, hi = x.amin(2, keepdim=True), x.amax(2, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(1e-12)
    y = torch.round((x - lo) / scale).clamp_(0, levels) * scale + lo
    y = y.to(kv.dtype).float()
    return {"rel_l2": float((x - y).norm() / x.norm()), "max_abs": float((x - y).abs().max())}


def video_bytes(samples: torch.Tensor, layout: str, tiling, resolution: int, preset: str) -> int:
    from kvreel.codec import layout as lay, video_cpu
    from kvreel.codec.chunk import frames_of
    L, _, B, T, H, D = samples.shape
    geo = lay.geometry(layout, resolution, T, H, D, tiling)
    frames, _ = frames_of(samples, geo, tiling, L, B)
    return len(video_cpu.encode_frames_verified(frames, geo.width, geo.height, preset=preset))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--preset", default="medium")
    a = ap.parse_args()
    from kv_capture import capture
    from kvreel.codec import layout as lay
    from kvreel.codec.layout_search import search
    import zstandard
    kv, _ = capture(a.model, a.tokens)
    L, _, T, H, D = kv.shape
    raw16 = kv.numel() * 2
    rows = []
    for bits in (None, 8, 6, 5, 4):
        t0 = time.time()
        s = quantize(kv, bits)
        flat = s.contiguous().numpy().tobytes()
        qbits = 16 if bits is None else bits
        fixed = lay.Tiling(head_rows=H, fold=1)          # one head per tile row: [H, D] as is
        best, sizes = search(s, a.resolution, a.preset)
        row = {
            "quant": "none (16-bit, exact)" if bits is None else f"{bits}-bit per-channel",
            "error": {"rel_l2": 0.0, "max_abs": 0.0} if bits is None else dequant_error(kv, bits),
            "ratio": {
                "quantization alone": 16 / qbits,
                "+ naive video layout": raw16 / video_bytes(s, "naive", None, a.resolution, a.preset),
                "+ token-sliced inter-frame layout": raw16 / video_bytes(s, "tiled", fixed, a.resolution, a.preset),
                "+ intra-frame search": raw16 / video_bytes(s, "tiled", best, a.resolution, a.preset),
                "zlib -9": raw16 / len(zlib.compress(flat, 9)),
                "zstd -19": raw16 / len(zstandard.ZstdCompressor(level=19).compress(flat)),
                "lzma": raw16 / len(lzma.compress(flat, preset=9)),
            },
            "searched_tiling": best.as_dict(),
            "search_sizes_bytes": sizes,
        }
        vals = s.numpy()
        deltas = np.diff(vals.astype(np.int16), axis=3) % 256 if bits is not None else \
            np.diff(vals.astype(np.int16), axis=3) % 256
        row["entropy_bits_per_sample"] = {"values": entropy_bits(vals), "token_deltas": entropy_bits(deltas)}
        row["order0_bound_ratio"] = 16 / (entropy_bits(vals) * (2 if bits is None else 1))
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(row["quant"], {k: round(v, 3) for k, v in row["ratio"].items()}, row["entropy_bits_per_sample"],
              row["error"], flush=True)
    path = save("codec_compression", {"model": a.model, "tokens": T, "shape": list(kv.shape),
                                      "resolution": a.resolution, "x265_preset": a.preset, "rows": rows})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(rows[0]["ratio"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        ax.bar(np.arange(len(rows)) + i * width, [r["ratio"][lab] for r in rows], width, label=lab)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [r["quant"] for r in rows], fontsize=8)
    ax.set_ylabel("compression ratio over raw 16-bit KV")
    ax.set_title(f"KV of {Path(a.model).name}, {T} tokens of Python source (post-RoPE keys)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
