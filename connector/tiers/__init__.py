"""The storage tiers a chunk can live in, below vLLM's own paged cache.

Every tier stores whole chunks (a payload ``[regions, blocks, block_bytes]``
of paged KV, keyed by the hash of the chunk's last block) behind the same small
interface, ``ChunkTier``; the scheduler side decides what goes where, the
worker side calls the tiers.

    host    memory of the worker process (pinned on CUDA)      tiers.host
    disk    one self-checking file per chunk, survives restarts  tiers.disk
    remote  a store shared by engines (Redis or a directory)    tiers.remote
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

import torch


class Tier(StrEnum):
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


class ChunkTier(Protocol):
    kind: Tier

    def put(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        """Store a chunk (the disk and remote tiers write behind, never blocking);
        False when the tier refused it."""

    def get(self, key: bytes) -> torch.Tensor:
        """The verified payload; ``ChunkUnavailable`` when it cannot be read,
        ``ChunkError`` when it is damaged."""

    def delete(self, key: bytes) -> None: ...

    def close(self) -> None: ...
