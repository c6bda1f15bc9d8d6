"""kvreel.codec: KV chunks as lossless video."""
