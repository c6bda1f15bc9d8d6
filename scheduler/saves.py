"""Save planning: which of a request's blocks go into which tiers this step."""

from __future__ import annotations

from array import array

from kvreel.codec.formats import chunk_key
from kvreel.connector.config import KVReelConfig
from kvreel.connector.metadata import GroupBlockIds, StoreOp
from kvreel.scheduler.chunks import DISK, HOST, REMOTE, Chunk, ChunkStore
from kvreel.scheduler.requests import RequestState, prompt_blocks
from kvreel.connector.vllm_internals import NULL_BLOCK


class SavePlanner:
    """Every full block is stored in the step that computes it (prompt and
    generated tokens alike), grouped into chunks that never cross a chunk
    boundary. Storing at once means vLLM never has to keep a finished
    request's blocks alive for a late save, so kvreel does not change vLLM's
    scheduling."""

    def __init__(self, cfg: KVReelConfig, store: ChunkStore, block_size: int, bytes_per_block: int,
                 remote: bool, history=None):
        self.cfg, self.store, self.block_size, self.bytes_per_block = cfg, store, block_size, bytes_per_block
        self.chunk_blocks = cfg.chunk_tokens // block_size
        self.remote = remote
        self.history = history

    def plan(self, st: RequestState, computed_after: int) -> None:
        """Store the request's full blocks computed by the end of this step."""
        if not st.block_ids:
            return
        if self.history is not None:
            self.history.plan(st.request.request_id, computed_after, st.block_ids[0], st.request.num_prompt_tokens,
                              st.request.max_tokens)
        hashes = st.request.block_hashes
        index = self.store.index
        full = min(computed_after // self.block_size, len(hashes), *(len(ids) for ids in st.block_ids))
        i = st.saved_upto
        if self.history is not None:        # blocks vLLM freed (kvreel holds them): their ids are someone else's now
            i = max(i, self.history.held(st.request.request_id))
        while i < full:
            if hashes[i] in index or not held_by_every_group(st, i):
                i += 1
                continue
            j = i
            boundary = (i // self.chunk_blocks + 1) * self.chunk_blocks
            while j < min(full, boundary) and hashes[j] not in index and held_by_every_group(st, j):
                j += 1
            user = st.user if i < prompt_blocks(st.request, self.block_size) else None  # prompts, not answers
            chunk = Chunk(chunk_key(hashes[i:j]), list(hashes[i:j]), (j - i) * self.bytes_per_block)
            if self.store.events is not None:
                chunk.parent = hashes[i - 1] if i else None
                chunk.token_ids = array("i", st.request.all_token_ids[i * self.block_size:j * self.block_size])
            self._new_chunk(chunk, tuple(ids[i:j] for ids in st.block_ids), st.from_remote, user)
            i = j
        st.saved_upto = max(st.saved_upto, full)

    def _new_chunk(self, chunk: Chunk, block_ids: GroupBlockIds, from_remote: set,
                   user: tuple[str, str] | None) -> None:
        store, block_hashes = self.store, chunk.block_hashes
        if user is not None:
            chunk.used_by(user)
        op = StoreOp(chunk.key, block_hashes, block_ids, set())
        store.plan_store(op)
        if self.cfg.cpu_bytes > 0 and store.admit(chunk, HOST):
            op.tiers.add(HOST)
        if DISK in store.budgets and store.admit(chunk, DISK):
            op.tiers.add(DISK)
        if self.remote and not all(h in from_remote for h in block_hashes):
            op.tiers.add(REMOTE)
            if store.events is not None:
                store.events.stored(chunk, REMOTE)
        if chunk.tiers:
            store.add(chunk)
        for tier in op.tiers:
            store.stats.add("saved_bytes", chunk.nbytes, tier)


def held_by_every_group(st: RequestState, position: int) -> bool:
    """A block is stored only whole: a sliding-window group may hold a position
    (a prefix vLLM found in its own cache) only as NULL_BLOCK."""
    return all(ids[position] != NULL_BLOCK for ids in st.block_ids)
