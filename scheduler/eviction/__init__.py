"""Eviction policies of the local tiers' byte budgets (``scheduler.chunks.TierBudget``):
the order in which a tier's unpinned chunks go. One policy per file behind
``base.EvictionPolicy``; ``KVREEL_EVICTION`` picks one (``policy_for``)."""

from __future__ import annotations

from typing import Callable

from kvreel.scheduler.eviction.base import EvictionPolicy
from kvreel.scheduler.eviction.lru import LRUPolicy
from kvreel.scheduler.eviction.workflow import WorkflowPolicy

__all__ = ["EvictionPolicy", "LRUPolicy", "WorkflowPolicy", "policy_for"]


def policy_for(steps: Callable | None) -> EvictionPolicy:
    """Workflow eviction where the scheduler ranks chunks by steps until their
    agent runs (``steps``), LRU otherwise."""
    return LRUPolicy() if steps is None else WorkflowPolicy(steps)
