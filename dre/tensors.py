"""Tensor helpers shared by the DRE's indexes and the worker's histories."""

from __future__ import annotations

import torch


def grown(old: torch.Tensor, axis: int, size: int, used: int) -> torch.Tensor:
    """``old`` with room for ``size`` along ``axis``, its first ``used`` there copied
    (tensors that grow in place of ``torch.cat``, which copies all of them a step)."""
    shape = list(old.shape)
    shape[axis] = size
    out = torch.empty(shape, dtype=old.dtype)
    out.narrow(axis, 0, used).copy_(old.narrow(axis, 0, used))
    return out
