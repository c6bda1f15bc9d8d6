"""What the scheduler side remembers of each request between vLLM's hooks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreel.connector.metadata import GroupBlockIds


@dataclass
class PendingLoad:
    """What a lookup found for a request, kept until vLLM allocates its blocks."""
    start: int                 # first block to load (the ones before it are in vLLM's cache)
    local_end: int             # blocks [start, local_end) come from host or disk, the rest from the remote store
    remote: list[tuple[bytes, int]] = field(default_factory=list)   # (chunk key, row) of each remote block
    history_skip: int = 0      # blocks [0, history_skip) go into the request's retrieval history instead


@dataclass
class RequestState:
    request: object
    block_ids: GroupBlockIds = ()                    # per KV cache group, position by position
    saved_upto: int = 0          # blocks below this are stored (or were skipped)
    cached_blocks: int = 0       # blocks vLLM found in its own cache when it scheduled the request
    pending: PendingLoad | None = None               # a lookup's finding, until its blocks are allocated
    load: tuple[int, set[int]] | None = None         # (first block, block ids of group 0) of its load in flight
    counted_lookup: bool = False
    from_remote: set = field(default_factory=set)   # hashes this request loaded from the remote tier
    user: tuple[str, str] | None = None             # (workflow, agent) from the request's hints


def prompt_blocks(request, block_size: int) -> int:
    """Full blocks of a request's prompt."""
    return getattr(request, "num_prompt_tokens", request.num_tokens) // block_size
