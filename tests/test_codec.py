"""kvreel.codec on the CPU (PyAV/libx265): byte-exact round trips and clear errors."""

from pathlib import Path

import pytest
import torch

from kvreel.codec import ChunkError, decode_chunk, encode_chunk, read_header
from kvreel.codec.container import pack, unpack_header
from kvreel.codec.layout import candidate_tilings
from kvreel.codec.quant import quant_error

DATA = Path(__file__).parent / "data"
SHAPES = {  # layers, tokens, kv_heads, head_dim
    "gqa-d64": (4, 70, 2, 64),
    "mha-d128": (2, 40, 4, 128),
    "gqa-d128": (3, 33, 1, 128),
}


def kv_of(shape, dtype, seed=0):
    L, T, H, D = shape
    g = torch.Generator().manual_seed(seed)
    # smooth along tokens plus noise, roughly like real KV
    base = torch.randn(L, 2, 1, H, D, generator=g)
    return (base + 0.3 * torch.randn(L, 2, T, H, D, generator=g)).to(dtype)


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("layout", ["naive", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lossless_round_trip_every_resolution(shape, layout, dtype):
    kv = kv_of(SHAPES[shape], dtype)
    data = encode_chunk(kv, quant="none", layout=layout, resolutions=(144, 288))
    for res in (144, 288):
        assert same_bits(decode_chunk(data, resolution=res), kv)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("layout", ["naive", "auto"])
def test_int8_round_trip_within_its_stated_error(shape, layout):
    kv = kv_of(SHAPES[shape], torch.float16)
    data = encode_chunk(kv, quant="int8", layout=layout, resolutions=(144, 288))
    outs = [decode_chunk(data, resolution=r) for r in (144, 288)]
    assert same_bits(outs[0], outs[1])                       # every resolution decodes the same bytes
    x = kv.float()
    step = (x.amax(2) - x.amin(2)) / 255                     # per (layer, K/V, head, channel)
    err = (outs[0].float() - x).abs()
    assert (err <= step.unsqueeze(2) / 2 + 2e-3 * x.abs() + 1e-6).all()   # half a step + fp16 rounding
    assert quant_error(kv, outs[0])["rel_l2"] < 0.01


def test_decode_into_out_and_header():
    kv = kv_of(SHAPES["gqa-d64"], torch.bfloat16)
    data = encode_chunk(kv, resolutions=(144,), token_start=512, block_size=16, model="tiny")
    h = read_header(data)
    assert (h.shape, h.dtype, h.token_start, h.block_size, h.model) == ([4, 70, 2, 64], "bfloat16", 512, 16, "tiny")
    out = torch.zeros_like(kv)
    assert decode_chunk(data, out=out) is out and same_bits(out, kv)


def test_tiling_candidates_follow_the_rules():
    cands = candidate_tilings(8, 128)
    assert len(cands) == 4 * 8                                  # log2(8)+1 by log2(128)+1
    x = torch.arange(8 * 128).view(8, 128)
    for t in cands:
        tile = t.to_tiles(x)
        assert torch.equal(t.from_tiles(tile, 8, 128), x)
        th, tw = t.tile_shape(8, 128)
        # heads never mix: every row-slice of a head's block holds one head's values, in order
        hc, w = 8 // t.head_rows, 128 // t.fold
        for h in range(8):
            i, j = divmod(h, hc)
            block = tile[i * t.fold:(i + 1) * t.fold, j * w:(j + 1) * w]
            assert torch.equal(block.reshape(-1), x[h])


def test_wrong_model_shape_is_refused_and_untouched():
    kv = kv_of(SHAPES["gqa-d64"], torch.bfloat16)
    data = encode_chunk(kv, resolutions=(144,))
    for bad in (torch.zeros(4, 2, 70, 2, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 70, 2, 64)):
        with pytest.raises(ChunkError, match="wrong model shape"):
            decode_chunk(data, out=bad)
        assert not bad.any()


@pytest.mark.parametrize("where,message", [
    (lambda n: n - 3, "bitstream at resolution 144 checksum mismatch"),
    (lambda n: 30, "chunk header checksum mismatch"),
    (lambda n: 1, "bad magic"),
])
def test_damaged_chunk_raises_and_writes_nothing(where, message):
    kv = kv_of(SHAPES["gqa-d64"], torch.bfloat16)
    data = bytearray(encode_chunk(kv, resolutions=(144,)))
    data[where(len(data))] ^= 0x21
    out = torch.zeros_like(kv)
    with pytest.raises(ChunkError, match=message):
        decode_chunk(bytes(data), out=out)
    assert not out.any()


def test_layers_are_handed_on_as_their_frames_verify():
    kv = kv_of(SHAPES["gqa-d64"], torch.bfloat16)            # 4 layers: triplets 0-2 and 3
    data = encode_chunk(kv, resolutions=(144,))
    parts = []
    out = decode_chunk(data, on_layers=lambda first, layers: parts.append((first, layers.clone())))
    assert same_bits(out, kv)
    assert [first for first, _ in parts] == [0, 3]
    assert same_bits(parts[0][1], kv[0:3]) and same_bits(parts[1][1], kv[3:4])

    # a frame of the second triplet decodes wrong: the first triplet was handed on, the second never is
    header, base = unpack_header(data)
    header.streams[0].frame_sums[-1] ^= 1
    parts.clear()
    with pytest.raises(ChunkError, match="1 decoded frame\\(s\\) failed their checksum"):
        decode_chunk(pack(header, [data[base:]]), on_layers=lambda first, layers: parts.append(first))
    assert parts == [0]


def test_truncated_and_foreign_chunks():
    kv = kv_of(SHAPES["gqa-d64"], torch.bfloat16)
    data = encode_chunk(kv, resolutions=(144, 288))
    with pytest.raises(ChunkError, match="cut short"):
        decode_chunk(data[:-10], resolution=288)
    with pytest.raises(ChunkError, match="truncated"):
        decode_chunk(data[:12])
    with pytest.raises(ChunkError, match="no resolution 999"):
        decode_chunk(data, resolution=999)
    with pytest.raises(ChunkError, match="bad magic"):
        decode_chunk(b"\x89PNG\r\n\x1a\n" + bytes(100))


def test_bad_arguments():
    kv = kv_of(SHAPES["gqa-d64"], torch.bfloat16)
    with pytest.raises(ValueError, match="quant must be one of"):
        encode_chunk(kv, quant="int4")
    with pytest.raises(ValueError, match="layout must be one of"):
        encode_chunk(kv, layout="zigzag")
    with pytest.raises(ValueError, match=r"\[layers, 2, tokens, kv_heads, head_dim\]"):
        encode_chunk(kv[0])


def test_committed_fixture_still_decodes():
    """The stream the GPU test decodes with NVDEC decodes here with PyAV to the same KV."""
    raw = torch.frombuffer(bytearray((DATA / "kv_small.bin").read_bytes()), dtype=torch.uint8)
    ref = raw.view(torch.bfloat16).view(3, 2, 96, 2, 64)
    blob = (DATA / "kv_small.kvrc").read_bytes()
    for res in (144, 288):
        assert same_bits(decode_chunk(blob, resolution=res), ref)
