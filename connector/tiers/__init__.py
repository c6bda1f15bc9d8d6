"""The storage tiers a chunk can live in, below vLLM's own paged cache: their
worker halves.

Every tier stores whole chunks (a payload ``[regions, blocks, block_bytes]``
of paged KV, keyed by the digest of its block hashes) behind the same
interface, ``ChunkTier``; the worker drives every tier through that interface
alone. Each tier's scheduler half decides what it holds, in
``kvreel.scheduler``; ``specs.TierSpec`` pairs the two halves of each tier, so
a new tier (an object store, a peer engine) is a spec, a worker half here and a
scheduler half there:

    tier    worker half (here)                                  scheduler half
    host    memory of the worker process (pinned on CUDA)       chunks.TierBudget + an eviction policy
    disk    one self-checking file per chunk, survives restarts  chunks.TierBudget + an eviction policy
    remote  a store shared by engines (Redis or a directory)     remote_lookups.RemoteLookups
"""

from __future__ import annotations

import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum

import torch


class Tier(StrEnum):
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


@dataclass(frozen=True)
class TierChanges:
    """What happened to a tier since the worker last asked."""
    went_off: str | None = None         # why it turned off
    came_back: bool = False


class ChunkTier(ABC):
    """A tier as the worker drives it. Tiers that write behind (disk, remote)
    override the reporting methods; the defaults suit one that writes at once."""

    kind: Tier

    @abstractmethod
    def put(self, key: bytes, block_hashes: list[bytes], payload: torch.Tensor) -> bool:
        """Store a chunk (the disk and remote tiers write behind, never blocking);
        False when the tier refused it (then it is also a failed write)."""

    @abstractmethod
    def get(self, key: bytes) -> torch.Tensor:
        """The verified payload; ``ChunkUnavailable`` when it cannot be read,
        ``ChunkError`` when it is damaged."""

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (at most ``timeout_s``) until the writes behind are done; False if some are not."""
        return True

    def take_failed_writes(self) -> set[bytes]:
        """Chunks whose write did not land since the last call."""
        return set()

    def take_changes(self) -> "TierChanges":
        """Whether the tier turned off (and why) or came back on since the last call."""
        return TierChanges()

    def take_encode_seconds(self) -> dict[str, float]:
        """Time spent encoding stored forms since the last call, per form (for the metrics)."""
        return {}

    def close(self) -> None:
        """Finish or drop the writes behind (bounded) and release the tier."""


def wait_for_queues(queues: list[queue.Queue], timeout_s: float | None) -> bool:
    """Wait (at most ``timeout_s``; None: no bound) until every job put on the
    queues is done; False if some are not."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for jobs in queues:
        while jobs.unfinished_tasks and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
    return not any(jobs.unfinished_tasks for jobs in queues)


WRITER_NICE = 10        # how much lower than the engine's a writer thread's CPU priority is


def yield_to_the_engine() -> None:
    """Lower the calling thread's CPU priority by ``WRITER_NICE`` (on Linux a
    thread has its own nice value): a tier's writes behind (checksums, file and
    network writes, video encoding) then take a core only when the engine's
    steps and the API server leave it idle. On a 2-core host, with every
    computed chunk written to disk, a request that reuses nothing saw p99 TTFT
    1.14x plain vLLM's at full priority and 1.10x below it (bench/README.md)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE)
    except OSError:            # no per-thread priority here: the writes still run, at the engine's
        pass
