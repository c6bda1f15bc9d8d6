"""The ``kvreel`` serde for LMCache's multiprocess (MP) mode.

LMCache runs a serde around any L2 adapter named in ``--l2-adapter``::

    {"type": "plugin", "module_path": "kvreel.connector.lmcache.l2_adapter",
     "class_name": "KVReelL2Adapter", "adapter_params": {"url": "redis://127.0.0.1:6379/0"},
     "serde": {"type": "kvreel", "form": "video", "quant": "none"}}

Options: ``form`` video|zstd|raw (default video), ``quant`` none|int8 (int8
only with video; default none = exact), ``resolutions`` (frame sides, default
the codec's), ``workers`` (serde threads, default 2), ``encoder`` auto|nvenc|cpu.
Importing this module registers the serde (the kvreel L2 adapter imports it,
so naming that adapter is enough; with another adapter, import this module first).
"""

from __future__ import annotations

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
from lmcache.v1.memory_management import MemoryObj

from kvreel.connector.lmcache.kv_object import check_options, decode_object, encode_object, group_tensors

SERDE_NAME = "kvreel"
_HEADROOM = 1 << 16


def object_key_string(key: ObjectKey) -> str:
    """A stable text form of an LMCache ObjectKey (stored inside each object)."""
    return f"{key.model_name}@{key.kv_rank}@{key.object_group_id}@{key.cache_salt}@{key.chunk_hash.hex()}"


def object_bytes(obj: MemoryObj) -> torch.Tensor:
    return obj.raw_tensor.view(torch.uint8).flatten()


class KVReelSerializer(Serializer):
    def __init__(self, form: str = "video", quant: str = "none", resolutions=None, encoder: str = "auto"):
        check_options(form, quant)
        self.form, self.quant, self.resolutions, self.encoder = form, quant, resolutions, encoder

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        blob = encode_object(object_key_string(key), group_tensors(src), form=self.form, quant=self.quant,
                             resolutions=self.resolutions, encoder=self.encoder)
        out = object_bytes(dst)
        if len(blob) > out.numel():
            raise ValueError(f"kvreel serde: {len(blob)} serialized bytes exceed the {out.numel()}-byte buffer")
        out[: len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        return len(blob)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        raw = sum(s.numel() * d.itemsize for s, d in zip(layout_desc.shapes, layout_desc.dtypes))
        # lossless HEVC of incompressible samples can exceed the input (~15 % seen)
        return raw + raw // 4 + _HEADROOM if self.form == "video" else raw + raw // 64 + _HEADROOM


class KVReelDeserializer(Deserializer):
    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        decode_object(object_bytes(src).numpy(), object_key_string(key), group_tensors(dst),
                      device=dst.raw_tensor.device)


def make_serde(kwargs: dict) -> SerdeProcessor:
    unknown = set(kwargs) - {"form", "quant", "resolutions", "workers", "encoder"}
    if unknown:
        raise ValueError(f"kvreel serde: unknown option(s) {sorted(unknown)}; "
                         "known: form, quant, resolutions, workers, encoder")
    opts = dict(kwargs)
    workers = int(opts.pop("workers", 2))
    if workers < 1:
        raise ValueError(f"kvreel serde: workers must be >= 1, got {workers}")
    return AsyncSerdeProcessor(KVReelSerializer(**opts), KVReelDeserializer(), max_workers=workers)


if SERDE_NAME not in get_registered_serde_types():
    register_serde_factory(SERDE_NAME, make_serde)
