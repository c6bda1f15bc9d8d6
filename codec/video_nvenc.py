"""NVENC lossless HEVC 4:4:4 encoding through PyNvVideoCodec, where the GPU has it.

Many data-center GPUs have no NVENC (an H100 has none: opening an encoder
fails), so ``available()`` probes once and callers fall back to libx265. Every
bitstream is verified by decoding it before it is used (``encode_frames_verified``
in ``chunk.py``), so a misbehaving hardware encoder can cost speed, never bytes.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from typing import Iterable

import numpy as np

logger = logging.getLogger(__name__)


_PROBE = """
import sys, PyNvVideoCodec as nvc
enc = nvc.CreateEncoder(256, 256, "YUV444", True, codec="hevc", tuning_info="lossless", gpuid=int(sys.argv[1]))
enc.EndEncode()
"""


@functools.lru_cache(maxsize=None)
def available(gpu_id: int = 0) -> bool:
    """Probe in a child process: on a GPU without NVENC the failed session left
    this process's NVDEC decoders unusable (measured on an H100: the next decode
    aborted), so the probe must not run here."""
    try:
        import PyNvVideoCodec  # noqa: F401
        import torch
        if not torch.cuda.is_available():
            return False
    except ImportError:
        return False
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, str(gpu_id)], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.info("kvreel: NVENC probe failed (%s); encoding with libx265", e)
        return False
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no reason given"])[-1]
        logger.info("kvreel: NVENC unavailable (%s); encoding with libx265", reason)
    return proc.returncode == 0


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
