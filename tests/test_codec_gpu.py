"""NVDEC decoding (GPU machine): bit-identical to PyAV's decode of the same stream."""

from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parent / "data"
pytestmark = pytest.mark.gpu


def reference() -> torch.Tensor:
    raw = torch.frombuffer(bytearray((DATA / "kv_small.bin").read_bytes()), dtype=torch.uint8)
    return raw.view(torch.bfloat16).view(3, 2, 96, 2, 64)


@pytest.mark.parametrize("resolution", [144, 288])
def test_nvdec_decode_is_bit_exact(resolution):
    pytest.importorskip("PyNvVideoCodec")
    from kvreel.codec import decode_chunk
    blob = (DATA / "kv_small.kvrc").read_bytes()
    kv = decode_chunk(blob, resolution=resolution, device="cuda", decoder="nvdec")
    assert kv.is_cuda
    assert torch.equal(kv.cpu().view(torch.uint8), reference().view(torch.uint8))


def test_nvdec_matches_pyav_frame_by_frame():
    pytest.importorskip("PyNvVideoCodec")
    av = pytest.importorskip("av")  # noqa: F841
    from kvreel.codec.container import section_bytes, unpack_header
    from kvreel.codec import video_cpu, video_nvdec
    blob = (DATA / "kv_small.kvrc").read_bytes()
    header, base = unpack_header(blob)
    bitstream = bytes(section_bytes(blob, base, header.streams[0].bitstream, "bitstream"))
    cpu = [torch.from_numpy(f.copy()) for f in video_cpu.decode_frames(bitstream)]
    gpu = [f.cpu() for f in video_nvdec.decode_frames(bitstream)]
    assert len(cpu) == len(gpu) > 0
    assert all(torch.equal(a, b) for a, b in zip(cpu, gpu))


def test_encode_on_a_gpu_machine_round_trips_through_nvdec():
    """encoder="auto": NVENC where present (an H100 has none: libx265 then);
    whichever encoded it, NVDEC decodes the KV back bit for bit."""
    pytest.importorskip("PyNvVideoCodec")
    pytest.importorskip("av")
    from kvreel.codec import decode_chunk, encode_chunk
    from kvreel.codec import video_nvenc
    kv = reference()
    blob = encode_chunk(kv, quant="none", layout="auto", resolutions=(144,), encoder="auto")
    out = decode_chunk(blob, device="cuda", decoder="nvdec")
    assert torch.equal(out.cpu().view(torch.uint8), kv.view(torch.uint8))
    assert isinstance(video_nvenc.available(), bool)
