"""Agent-workflow prefetch (KVFlow): the chunks of the agents about to run are
read from disk or the remote store into the host tier in the background,
nearest agent first, bounded in bytes in flight, and only into room held by
chunks needed later. The workflow hints and steps-to-execution are
``kvreel.scheduler.workflow``'s."""

from __future__ import annotations

from collections import OrderedDict

from kvreel.connector.config import KVReelConfig
from kvreel.scheduler.chunks import DISK, HOST, REMOTE, Chunk, ChunkStore
from kvreel.scheduler.requests import RequestState, prompt_blocks
from kvreel.connector.tiers import Tier
from kvreel.scheduler.workflow import FAR, WorkflowTracker


class Prefetcher:
    def __init__(self, cfg: KVReelConfig, store: ChunkStore, workflows: WorkflowTracker, block_size: int,
                 workers: int, remote: bool):
        self.cfg, self.store, self.workflows = cfg, store, workflows
        self.block_size, self.workers, self.remote = block_size, workers, remote
        self._agent_chunks: dict[tuple[str, str], OrderedDict[bytes, Chunk]] = {}
        self._in_flight: dict[bytes, Chunk] = {}
        self._landed: dict[bytes, int] = {}           # workers that have it
        self._bytes = 0

    def steps(self, chunk: Chunk) -> float:
        """Steps until the nearest agent that used ``chunk`` runs (FAR: unhinted)."""
        return min((self.workflows.steps(u) for u in chunk.users), default=FAR)

    def remember_prompt(self, st: RequestState) -> None:
        """What an agent's next request will most likely start with: the chunks
        of its last prompt (the prefetch target)."""
        chunks: OrderedDict[bytes, Chunk] = OrderedDict()
        for h in st.request.block_hashes[:prompt_blocks(st.request, self.block_size)]:
            chunk = self.store.holder(h)
            if chunk is not None:
                chunks[chunk.key] = chunk
        self._agent_chunks[st.user] = chunks

    def _source(self, chunk: Chunk) -> Tier | None:
        """Where a prefetch can read ``chunk`` from: its disk copy, or the remote
        store once it has left every local tier (uploaded when it was made)."""
        if self.store.indexed(chunk):
            return DISK if DISK in chunk.tiers else None
        if self.remote and not any(h in self.store.index for h in chunk.block_hashes):
            return REMOTE
        return None

    def plan(self) -> list[tuple[bytes, Tier]]:
        """This step's prefetches: (chunk key, tier to read it from)."""
        if not self.cfg.prefetch_depth or self.cfg.cpu_bytes <= 0:
            return []
        host = self.store.host
        out: list[tuple[bytes, Tier]] = []
        for user, steps in self.workflows.upcoming(self.cfg.prefetch_depth):
            chunks = self._agent_chunks.get(user, {})
            for key, chunk in list(chunks.items()):
                if key in host.lru or key in self._in_flight:
                    continue
                source = self._source(chunk)
                if source is None:
                    if not self.store.indexed(chunk):
                        del chunks[key]              # gone, and nowhere to fetch it from
                    continue
                if self._bytes + chunk.nbytes > self.cfg.prefetch_bytes:
                    return out
                if not self.store.admit(chunk, HOST, present=False, nearest=steps, strictly=True):
                    return out                       # host memory holds only nearer chunks
                chunk.pins += 1
                self._in_flight[key] = chunk
                self._bytes += chunk.nbytes
                self.store.stats.add("prefetches", label="issued")
                out.append((key, source))
        return out

    def landed(self, key: bytes, workers: int) -> None:
        """``workers`` more workers hold a prefetched chunk: done once all do."""
        self._landed[key] = self._landed.get(key, 0) + workers
        if self._landed[key] >= self.workers:
            self.done(key, True)

    def done(self, key: bytes, ok: bool) -> None:
        chunk = self._in_flight.pop(key, None)
        self._landed.pop(key, None)
        if chunk is None:
            return
        chunk.pins -= 1
        self._bytes -= chunk.nbytes
        store = self.store
        if ok and (store.indexed(chunk) or not any(h in store.index for h in chunk.block_hashes)):
            store.hold(chunk, HOST)
            chunk.prefetched = True
            store.add(chunk)                         # a chunk fetched back from the remote store
        else:
            store.release(chunk, HOST)
            if not ok:
                store.stats.add("prefetches", label="failed")
                for user in chunk.users:                  # not asked for again
                    self._agent_chunks.get(user, {}).pop(key, None)
