"""Workflow eviction (KVFlow): the chunks whose agents run furthest in the future
go first, LRU among equals (``KVREEL_EVICTION=workflow``; the steps come from
``kvreel.scheduler.workflow``'s hints)."""

from __future__ import annotations

from typing import Callable, Iterable

from kvreel.scheduler.eviction.base import Chunk, EvictionPolicy


class WorkflowPolicy(EvictionPolicy):
    def __init__(self, steps: Callable[[Chunk], float]):
        self.steps = steps            # chunk -> steps until one of its agents runs

    def need(self, chunk: Chunk) -> float:
        return self.steps(chunk)

    def order(self, lru: Iterable[Chunk], nearest: float, strictly: bool) -> Iterable[Chunk]:
        # one pass over the tier per eviction; a stable sort keeps LRU order among equals
        ranked = sorted(((self.steps(c), c) for c in lru), key=lambda x: -x[0])
        return (c for d, c in ranked if d > nearest or (d == nearest and not strictly))
