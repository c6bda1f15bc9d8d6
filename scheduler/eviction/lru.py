"""LRU: the least recently used chunk goes first (vLLM's own offloading default)."""

from __future__ import annotations

from typing import Iterable

from kvreel.scheduler.eviction.base import Chunk, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    def order(self, lru: Iterable[Chunk], nearest: float, strictly: bool) -> Iterable[Chunk]:
        return lru
