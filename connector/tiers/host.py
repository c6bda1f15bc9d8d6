"""Host tier: chunk payloads in the worker's memory (pinned on CUDA).

What is kept and what is evicted is the scheduler side's decision (its LRU
byte budget); this is only the worker's dict of tensors."""

from __future__ import annotations

import torch

from kvreel.codec.formats import ChunkUnavailable
from kvreel.connector import freed_memory
from kvreel.connector.tiers import ChunkTier, Tier


class HostTier(ChunkTier):
    kind = Tier.HOST

    def __init__(self) -> None:
        self._chunks: dict[bytes, torch.Tensor] = {}

    def put(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        self._chunks[key] = payload if payload.device.type == "cpu" else payload.cpu()
        return True

    def get(self, key: bytes) -> torch.Tensor:
        data = self._chunks.get(key)
        if data is None:
            raise ChunkUnavailable("chunk is no longer in the host tier")
        return data

    def delete(self, key: bytes) -> None:
        data = self._chunks.pop(key, None)
        if data is not None:
            freed_memory.freed(data.nbytes)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def nbytes(self) -> int:
        """Bytes of the payloads held."""
        return sum(t.nbytes for t in list(self._chunks.values()))    # a copy: the save thread adds

    def close(self) -> None:
        self._chunks.clear()
