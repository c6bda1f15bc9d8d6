"""NVDEC decoding through PyNvVideoCodec (GPU machines).

Decodes an in-memory HEVC 4:4:4 bitstream with the GPU's video engines and
yields each frame as a [3, H, W] uint8 CUDA tensor (copied before the next
Decode call, as PyNvVideoCodec reuses its surfaces).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import hashlib
import threading

import numpy as np

if TYPE_CHECKING:
    import torch


def available() -> bool:
    try:
        import PyNvVideoCodec  # noqa: F401
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


_local = threading.local()


def parameter_sets(bitstream: bytes) -> bytes:
    """The VPS/SPS/PPS NAL units that open an Annex-B HEVC stream."""
    out = []
    pos = bitstream.find(b"\x00\x00\x01")
    while pos != -1:
        start = pos + 3
        nxt = bitstream.find(b"\x00\x00\x01", start)
        nal_type = (bitstream[start] >> 1) & 0x3F if start < len(bitstream) else -1
        if nal_type < 32:          # first coded slice: the parameter sets are behind us
            break
        if nal_type in (32, 33, 34):
            out.append(bitstream[start:nxt if nxt != -1 else len(bitstream)].rstrip(b"\x00"))
        pos = nxt
    return b"".join(out)


def _decoder(gpu_id: int, params: bytes):
    """One decoder per thread, GPU and stream configuration, reused across chunks:
    creating a decoder while another exists cost ~0.2 s on an H100 (measured),
    decoding a 512x512 chunk of 8 frames ~0.04 s. A decoder fed a stream with
    other parameter sets after end of stream misdecoded (measured), so the key
    is the stream's VPS/SPS/PPS bytes."""
    import PyNvVideoCodec as nvc
    cache = _local.__dict__.setdefault("decoders", {})
    key = (gpu_id, hashlib.sha1(params).digest())
    if key not in cache:
        cache[key] = nvc.CreateDecoder(gpuid=gpu_id, codec=nvc.cudaVideoCodec.HEVC, usedevicememory=True,
                                          outputColorType=nvc.OutputColorType.NATIVE)
    return cache[key]


def decode_frames(bitstream: bytes, gpu_id: int = 0) -> Iterator["torch.Tensor"]:
    import PyNvVideoCodec as nvc
    import torch
    decoder = _decoder(gpu_id, parameter_sets(bitstream))
    buf = np.frombuffer(bitstream, dtype=np.uint8)
    packet = nvc.PacketData()
    packet.bsl_data = buf.ctypes.data
    packet.bsl = buf.size
    eos = nvc.PacketData()  # empty packet: end of stream, drains the decoder
    for pkt in (packet, eos):
        for frame in decoder.Decode(pkt):
            t = torch.from_dlpack(frame).clone()   # planar [3H, W] for 4:4:4 8-bit
            yield t.view(3, t.shape[0] // 3, t.shape[1])
