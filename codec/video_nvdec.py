"""NVDEC decoding through PyNvVideoCodec (GPU machines).

Decodes an in-memory HEVC 4:4:4 bitstream with the GPU's video engines and
yields each frame as a [3, H, W] uint8 CUDA tensor (copied before the next
Decode call, as PyNvVideoCodec reuses its surfaces).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def available() -> bool:
    try:
        import PyNvVideoCodec  # noqa: F401
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def decode_frames(bitstream: bytes, gpu_id: int = 0) -> Iterator["torch.Tensor"]:
    import PyNvVideoCodec as nvc
    import torch
    decoder = nvc.CreateDecoder(gpuid=gpu_id, codec=nvc.cudaVideoCodec.HEVC, usedevicememory=True,
                                outputColorType=nvc.OutputColorType.NATIVE)
    buf = np.frombuffer(bitstream, dtype=np.uint8)
    packet = nvc.PacketData()
    packet.bsl_data = buf.ctypes.data
    packet.bsl = buf.size
    eos = nvc.PacketData()  # empty packet: end of stream, drains the decoder
    for pkt in (packet, eos):
        for frame in decoder.Decode(pkt):
            t = torch.from_dlpack(frame).clone()   # planar [3H, W] for 4:4:4 8-bit
            yield t.view(3, t.shape[0] // 3, t.shape[1])
