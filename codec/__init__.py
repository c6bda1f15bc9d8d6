"""kvreel.codec: KV chunks as lossless video (KVFetcher's layout), decoded on NVDEC or the CPU.

    data = encode_chunk(kv, quant="none", layout="auto", resolutions=(256, 512))
    kv2 = decode_chunk(data, resolution=256)          # byte-exact for quant="none"
"""

from kvreel.codec.chunk import decode_chunk, encode_chunk, read_header
from kvreel.codec.formats import ChunkError, ChunkUnavailable

__all__ = ["encode_chunk", "decode_chunk", "read_header", "ChunkError", "ChunkUnavailable"]
