"""Lossless HEVC 4:4:4 8-bit through PyAV (libx265 encode, FFmpeg hevc decode).

Frames are written into and read out of the planes directly: PyAV would
otherwise run swscale when formats differ, and ``from_ndarray`` does not cover
every planar layout, so this is the bit-exact path.
"""

from __future__ import annotations

import fractions
from typing import Iterable, Iterator

import numpy as np

PIX_FMT = "yuv444p"


def encode_frames(frames: Iterable[np.ndarray], width: int, height: int, *, preset: str = "fast",
                  threads: int = 0, extra: str = "") -> bytes:
    """[3, height, width] uint8 frames -> an Annex-B HEVC bitstream (lossless)."""
    import av
    enc = av.CodecContext.create("libx265", "w")
    enc.width, enc.height, enc.pix_fmt = width, height, PIX_FMT
    enc.time_base = fractions.Fraction(1, 30)
    # Measured here: libx265 "lossless" streams with B-frames or sub-pel motion
    # search decoded with a few samples off in ~2 % of frames (FFmpeg's decoder);
    # P-frames with integer-pel diamond search decoded bit-exactly. Callers still
    # verify (encode_frames_verified) and fall back to intra-only.
    params = f"lossless=1:bframes=0:me=dia:subme=0:log-level=error:info=0{extra}"
    if threads:
        params += f":pools={threads}:frame-threads={min(threads, 4)}"
    enc.options = {"x265-params": params, "preset": preset}
    out: list[bytes] = []
    for i, arr in enumerate(frames):
        frame = av.VideoFrame(width, height, PIX_FMT)
        for p in range(3):
            plane = frame.planes[p]
            np.frombuffer(plane, np.uint8).reshape(height, plane.line_size)[:, :width] = arr[p]
        frame.pts = i
        out += [bytes(pkt) for pkt in enc.encode(frame)]
    out += [bytes(pkt) for pkt in enc.encode(None)]
    return b"".join(out)


def encode_frames_verified(frames: list[np.ndarray], width: int, height: int, *, preset: str = "fast",
                           threads: int = 0, use_nvenc: bool = False) -> bytes:
    """Encode (NVENC when asked and present, else libx265), then decode once
    more to prove the stream is lossless; on any difference re-encode with
    libx265 intra-only (``keyint=1``), which decoded exactly in every case seen."""
    if use_nvenc:
        from kvreel.codec import video_nvenc
        bitstream = video_nvenc.encode_frames(frames, width, height)
    else:
        bitstream = encode_frames(frames, width, height, preset=preset, threads=threads)
    if _decodes_to(bitstream, frames):
        return bitstream
    return encode_frames(frames, width, height, preset=preset, threads=threads, extra=":keyint=1")


def _decodes_to(bitstream: bytes, frames: list[np.ndarray]) -> bool:
    try:
        decoded = list(decode_frames(bitstream))
    except ValueError:
        return False
    return len(decoded) == len(frames) and all(np.array_equal(a, b) for a, b in zip(frames, decoded))


def decode_frames(bitstream: bytes) -> Iterator[np.ndarray]:
    """An HEVC bitstream -> [3, height, width] uint8 frames, one at a time."""
    import av
    dec = av.CodecContext.create("hevc", "r")
    try:
        packets = dec.parse(bitstream) + dec.parse(None)
        for pkt in packets:
            for frame in dec.decode(pkt):
                yield _planes(frame)
        for frame in dec.decode(None):
            yield _planes(frame)
    except av.error.FFmpegError as e:
        raise ValueError(f"HEVC decode failed: {e}") from None


def _planes(frame) -> np.ndarray:
    if frame.format.name != PIX_FMT:
        raise ValueError(f"decoded frame is {frame.format.name}, expected {PIX_FMT}")
    w, h = frame.width, frame.height
    return np.stack([np.frombuffer(frame.planes[p], np.uint8).reshape(h, frame.planes[p].line_size)[:, :w]
                     for p in range(3)])
