"""NVENC lossless HEVC 4:4:4 encoding through PyNvVideoCodec, where the GPU has it.

Many data-center GPUs have no NVENC (an H100 has none: opening an encoder
fails), so ``available()`` probes once and callers fall back to libx265. Every
bitstream is verified by decoding it before it is used (``encode_frames_verified``
in ``chunk.py``), so a misbehaving hardware encoder can cost speed, never bytes.
"""

from __future__ import annotations

import functools
import logging
from typing import Iterable

import numpy as np

logger = logging.getLogger("kvreel.codec")


@functools.lru_cache(maxsize=None)
def available(gpu_id: int = 0) -> bool:
    try:
        import PyNvVideoCodec as nvc
        import torch
        if not torch.cuda.is_available():
            return False
        enc = nvc.CreateEncoder(256, 256, "YUV444", True, codec="hevc", tuning_info="lossless", gpuid=gpu_id)
        enc.EndEncode()
        return True
    except Exception as e:  # the library raises plain exceptions for "no encoder on this GPU"
        logger.info("kvreel: NVENC unavailable (%s); encoding with libx265", e)
        return False


def encode_frames(frames: Iterable[np.ndarray], width: int, height: int, gpu_id: int = 0) -> bytes:
    """[3, height, width] uint8 frames -> lossless HEVC 4:4:4 Annex-B bitstream."""
    import PyNvVideoCodec as nvc
    enc = nvc.CreateEncoder(width, height, "YUV444", True, codec="hevc", tuning_info="lossless",
                            preset="P4", gpuid=gpu_id)
    out = []
    for arr in frames:
        out.append(bytes(enc.Encode(np.ascontiguousarray(arr).reshape(3 * height, width))))
    out.append(bytes(enc.EndEncode()))
    return b"".join(out)
