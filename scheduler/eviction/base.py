"""What an eviction policy decides: which of a tier's chunks go first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable, TypeVar

Chunk = TypeVar("Chunk")          # ``kvreel.scheduler.chunks.Chunk``; a policy reads nothing of it itself


class EvictionPolicy(ABC):
    """Orders a tier's eviction candidates. The budget (``TierBudget``) keeps the
    chunks in least-recently-used order and accounts the bytes; a policy only
    ranks, so it holds no state of its own about the chunks."""

    @abstractmethod
    def order(self, lru: Iterable[Chunk], nearest: float, strictly: bool) -> Iterable[Chunk]:
        """``lru`` (unpinned chunks, least recently used first) in eviction order,
        without those the policy protects: with a rank of need, a chunk needed
        sooner than ``nearest`` steps (no later, if ``strictly``) stays."""

    def need(self, chunk: Chunk) -> float:
        """How soon ``chunk`` is needed, as this policy ranks it (0: no ranking);
        a chunk being admitted may push out only chunks needed no sooner."""
        return 0
