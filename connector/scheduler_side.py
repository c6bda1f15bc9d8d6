"""Scheduler side of the connector: the index of every stored chunk, the tier
budgets and their LRU eviction, prefix lookups, and the per-step plan of saves
and loads sent to the workers.

With agent-workflow hints (``kvreel.scheduler.workflow``, KVFlow) the tiers
evict the chunks whose agents run furthest in the future first, and the chunks
of agents about to run are prefetched from disk or the remote store into the
host tier.

A *chunk* is a run of consecutive full blocks of one prefix, at most
``KVREEL_CHUNK_TOKENS`` long and never crossing a chunk boundary, keyed by the
hash of its last block. Block keys are vLLM's own chained prefix-cache block
hashes (sha256 by default, stable across processes), so a chunk's key names the
whole prefix up to it. Every block maps to (chunk, row), so any prefix of a
held chunk is reusable: reuse is at block granularity.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from kvreel.codec.formats import ChunkError
from kvreel.connector.block_copy import NULL_BLOCK, GroupBlockIds
from kvreel.connector.config import KVReelConfig, format_bytes
from kvreel.connector.metadata import HistoryPiece, KVReelMetadata, KVReelWorkerMeta, LoadOp, LoadPiece, StoreOp
from kvreel.connector.stats import KVReelStats
from kvreel.connector.tiers import Tier
from kvreel.connector.tiers.disk import scan_chunk_files
from kvreel.scheduler.workflow import FAR, WorkflowTracker

logger = logging.getLogger(__name__)
HOST, DISK, REMOTE = Tier.HOST, Tier.DISK, Tier.REMOTE


MAX_USERS = 64          # (workflow, agent) pairs remembered per chunk


class Chunk:
    __slots__ = ("key", "block_hashes", "nbytes", "tiers", "pins", "users", "prefetched")

    def __init__(self, key: bytes, block_hashes: list[bytes], nbytes: int):
        self.key = key
        self.block_hashes = block_hashes
        self.nbytes = nbytes
        self.tiers: set[Tier] = set()     # the local tiers (host, disk) holding it
        self.pins = 0
        self.users: set[tuple[str, str]] = set()   # (workflow, agent) pairs that used it
        self.prefetched = False           # in the host tier by a prefetch, not loaded since


class TierBudget:
    """Byte budget of one local tier: LRU order, or with ``steps`` (chunk ->
    steps until it is needed, workflow eviction) the furthest chunks first and
    LRU among equals."""

    def __init__(self, tier: Tier, capacity: int, steps=None):
        self.tier = tier
        self.capacity = capacity
        self.used = 0
        self.lru: OrderedDict[bytes, Chunk] = OrderedDict()
        self.steps = steps

    def touch(self, chunk: Chunk) -> None:
        if chunk.key in self.lru:
            self.lru.move_to_end(chunk.key)

    def victims_for(self, nbytes: int, nearest: float = 0, strictly: bool = False) -> list[Chunk] | None:
        """Unpinned chunks whose removal frees ``nbytes``, in eviction order;
        None if impossible. With workflow eviction only chunks needed no sooner
        than ``nearest`` steps (later than it, if ``strictly``) may go."""
        if nbytes > self.capacity:
            return None
        need = self.used + nbytes - self.capacity
        if need <= 0:
            return []
        candidates = (c for c in self.lru.values() if c.pins == 0)
        if self.steps is not None:
            # one pass over the tier per eviction; a stable sort keeps LRU order among equals
            ranked = [(self.steps(c), c) for c in candidates]
            candidates = (c for d, c in sorted(ranked, key=lambda x: -x[0])
                          if d > nearest or (d == nearest and not strictly))
        out = []
        for chunk in candidates:
            if need <= 0:
                break
            out.append(chunk)
            need -= chunk.nbytes
        return out if need <= 0 else None

    def add(self, chunk: Chunk) -> None:
        self.lru[chunk.key] = chunk
        self.used += chunk.nbytes

    def remove(self, chunk: Chunk) -> None:
        if self.lru.pop(chunk.key, None) is not None:
            self.used -= chunk.nbytes


def _prompt_blocks(request, block_size: int) -> int:
    """Full blocks of a request's prompt."""
    return getattr(request, "num_prompt_tokens", request.num_tokens) // block_size


@dataclass
class RequestState:
    request: object
    block_ids: GroupBlockIds = ()                    # per KV cache group, position by position
    saved_upto: int = 0          # blocks below this are stored (or were skipped)
    load: tuple[int, set[int]] | None = None       # (first block, block ids of group 0) of its load in flight
    counted_lookup: bool = False
    from_remote: set = field(default_factory=set)   # hashes this request loaded from the remote tier
    user: tuple[str, str] | None = None             # (workflow, agent) from the request's hints


class KVReelScheduler:
    def __init__(self, cfg: KVReelConfig, identity: str, block_size: int, bytes_per_block: int,
                 workers: int = 1, groups: int = 1):
        if cfg.chunk_tokens % block_size:
            raise ValueError(f"KVREEL_CHUNK_TOKENS={cfg.chunk_tokens} must be a multiple of the engine's "
                             f"block size ({block_size})")
        self.cfg = cfg
        self.identity = identity
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_tokens // block_size
        self.bytes_per_block = bytes_per_block
        self.index: dict[bytes, tuple[Chunk, int]] = {}
        self.workflows = WorkflowTracker() if cfg.eviction == "workflow" else None
        steps = self._steps if self.workflows is not None else None
        self.budgets: dict[Tier, TierBudget] = {HOST: TierBudget(HOST, cfg.cpu_bytes, steps)}
        if cfg.disk_dir:
            self.budgets[DISK] = TierBudget(DISK, cfg.disk_bytes, steps)
        self.workers = workers
        # vLLM maps failed block ids back to requests only with one KV cache group;
        # with more, every load is asynchronous and a failure is reported per request
        self.loads_by_request = groups > 1
        self._agent_chunks: dict[tuple[str, str], OrderedDict[bytes, Chunk]] = {}
        self._prefetching: dict[bytes, Chunk] = {}
        self._prefetch_landed: dict[bytes, int] = {}
        self._prefetch_bytes = 0
        self.reqs: dict[str, RequestState] = {}
        self.stats = KVReelStats()
        self._planned: dict[str, tuple[int, int]] = {}
        self._loads: list[LoadOp] = []
        self._stores: dict[bytes, StoreOp] = {}
        self._evictions: dict[Tier, list[bytes]] = {}
        self._sync_pins: list[Chunk] = []
        self._sync_loading: list[str] = []      # requests whose synchronous load runs in this step
        self._async_pins: dict[str, list[Chunk]] = {}
        self._promotions: dict[str, list[Chunk]] = {}
        self._remote_plans: dict[str, list[tuple[bytes, int]]] = {}
        self.remote = None
        self.blocking = cfg.fetch_mode == "blocking"
        self.history = None
        if cfg.retrieval != "off":
            from kvreel.connector.retrieval.history_plan import HistoryPlanner
            self.history = HistoryPlanner(block_size, cfg.retrieval_window, cfg.retrieval_min_tokens)
        self._history_skip: dict[str, int] = {}
        self._history_bytes = 0
        self._warned_history_over_host = False
        if cfg.remote_url:
            from kvreel.connector.tiers.remote import RemoteLookups
            self.remote = RemoteLookups(cfg.remote_url, identity, cfg.remote_timeout_s)
        if DISK in self.budgets:
            self._adopt_disk_chunks()
        logger.info("kvreel: host tier %s, disk tier %s, chunk %d tokens, %s per block",
                    format_bytes(cfg.cpu_bytes),
                    f"{cfg.disk_dir} ({format_bytes(cfg.disk_bytes)}, {len(self.budgets[DISK].lru)} chunks found)"
                    if DISK in self.budgets else "off", cfg.chunk_tokens, format_bytes(bytes_per_block))

    @property
    def host(self) -> TierBudget:
        return self.budgets[HOST]

    # -- startup -------------------------------------------------------------
    def _adopt_disk_chunks(self) -> None:
        found = []
        for key, path, header in scan_chunk_files(self.cfg.disk_dir, self.identity):
            if isinstance(header, ChunkError):
                self.stats.add("corrupt_chunks", label=DISK)
                logger.warning("kvreel: ignoring unusable chunk file: %s", header)
                continue
            if header.shape[1] != len(header.block_hashes) or header.payload_bytes != \
                    len(header.block_hashes) * self.bytes_per_block:
                self.stats.add("corrupt_chunks", label=DISK)
                logger.warning("kvreel: ignoring chunk %s: its shape %s does not match this engine's layout",
                               key.hex()[:16], header.shape)
                continue
            found.append((path.stat().st_mtime, key, header))
        for _, key, header in sorted(found):
            chunk = Chunk(key, list(header.block_hashes), header.payload_bytes)
            if self._admit(chunk, DISK):
                self._index(chunk)

    # -- lookup --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self.reqs.setdefault(request.request_id, RequestState(request))
        st.request = request
        if self.workflows is not None and st.user is None:
            st.user = self.workflows.on_request(request.request_id, getattr(request, "kv_transfer_params", None))
        hashes = request.block_hashes
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        n = 0
        while n < limit and hashes[n] in self.index:
            n += 1
        held_from_zero = n
        if st.user is not None:
            for h in hashes[:n]:
                self._use(self.index[h][0], st.user)
        start = num_computed_tokens // self.block_size
        n = max(n, start)               # blocks below `start` are in vLLM's own cache already
        local_end = n
        self._remote_plans.pop(request.request_id, None)
        if self.remote is not None and n < limit:
            found = self.remote.poll(request.request_id, hashes[n:limit])
            if found is None:
                return None, False      # lookup in flight: vLLM asks again next step
            if self.history is not None and self.history.window_start((n + len(found)) * self.block_size) > n:
                # A long request's blocks outside its window go into its history, which loads
                # from the local tiers only; remote blocks there would be loaded into vLLM's
                # cache and could fill it with one request that then cannot run (the soak
                # found that deadlock). They are recomputed, leaving vLLM's cache as they go.
                found = []
            n += len(found)
            self._remote_plans[request.request_id] = found
        if not st.counted_lookup and limit > n:
            st.counted_lookup = True
            self.stats.add("lookup_miss_blocks", limit - n)
        skip = 0
        if self.history is not None:
            # a long prefix kvreel holds from block 0 comes into the history, not into vLLM's cache
            # (only with something to load: the history arrives with the request's other loads)
            held = min(held_from_zero, local_end) if n > start and not self.blocking else 0
            skip = self.history.admission_skip(request.request_id, n * self.block_size, held)
        if n <= start:
            return 0, False
        self._planned[request.request_id] = (start, local_end)
        self._history_skip[request.request_id] = skip
        needs_async = n > local_end or skip > 0 or self.loads_by_request or \
            any(HOST not in self.index[h][0].tiers for h in hashes[start:local_end])
        return (n - start) * self.block_size, needs_async and not self.blocking

    def update_state_after_alloc(self, request, block_ids: GroupBlockIds, num_external_tokens: int) -> None:
        st = self.reqs.setdefault(request.request_id, RequestState(request))
        plan = self._planned.pop(request.request_id, None)
        if num_external_tokens == 0 or plan is None:
            return
        start = plan[0]
        end = start + num_external_tokens // self.block_size
        remote = self._remote_plans.pop(request.request_id, [])
        first_remote = plan[1]
        pieces: list[LoadPiece] = []
        chunks: list[Chunk] = []
        skip = self._history_skip.pop(request.request_id, 0)
        history = self._plan_history_loads(request, skip, chunks)
        for i in range(max(start, skip), end):
            if i >= first_remote:
                key, row = remote[i - first_remote]
                last = pieces[-1] if pieces else None
                if last and last.extends(key, row):
                    last.append(block_ids, i)
                else:
                    pieces.append(LoadPiece.at(key, REMOTE, row, block_ids, i))
                st.from_remote.add(request.block_hashes[i])
                continue
            chunk, row = self.index[request.block_hashes[i]]
            tier = HOST if HOST in chunk.tiers else DISK
            last = pieces[-1] if pieces else None
            if last and last.extends(chunk.key, row):
                last.append(block_ids, i)
                continue
            pieces.append(LoadPiece.at(chunk.key, tier, row, block_ids, i))
            self._pin_for_load(chunk, chunks, tier)
        for p in pieces:
            self.stats.add("lookup_hit_blocks", p.rows, p.tier)
        is_async = (any(p.tier != HOST for p in pieces) or bool(history) or self.loads_by_request) \
            and not self.blocking
        if is_async:
            self._async_pins[request.request_id] = chunks
        else:
            self._sync_pins += chunks
        # blocks loaded from the remote tier are saved into the local tiers once
        # the request runs (they are valid in its blocks then)
        st.saved_upto = max(st.saved_upto, min(end, first_remote))
        st.load = (start, set(block_ids[0][start:end]))
        self._loads.append(LoadOp(request.request_id, pieces, is_async, history))
        if self.history is not None:
            self.history.admitted(request.request_id, skip)

    def _pin_for_load(self, chunk: Chunk, chunks: list[Chunk], tier: Tier) -> None:
        """A chunk a load reads from: pinned once per load (no eviction under it), and recently used."""
        if chunk not in chunks:
            chunks.append(chunk)
            chunk.pins += 1
            for budget in self.budgets.values():
                budget.touch(chunk)
            if chunk.prefetched and tier == HOST:
                chunk.prefetched = False
                self.stats.add("prefetches", label="used")

    def _plan_history_loads(self, request, skip: int, chunks: list[Chunk]) -> list[HistoryPiece]:
        """Blocks ``[0, skip)`` of an admitted long prefix, from kvreel's local
        tiers into the request's history (their chunks pinned with the rest)."""
        pieces: list[HistoryPiece] = []
        for i in range(skip):
            chunk, row = self.index[request.block_hashes[i]]
            tier = HOST if HOST in chunk.tiers else DISK
            last = pieces[-1] if pieces else None
            if last and last.key == chunk.key and last.first + last.n == row:
                last.n += 1
                continue
            pieces.append(HistoryPiece(chunk.key, tier, row, 1, i))
            self._pin_for_load(chunk, chunks, tier)
        for p in pieces:
            self.stats.add("lookup_hit_blocks", p.n, p.tier)
        return pieces

    def planned_tokens_by_tier(self, req_id: str) -> dict[Tier, int]:
        """Tokens of this step's load for ``req_id``, per tier (vLLM's hit-source metrics)."""
        out: dict[Tier, int] = {}
        for op in self._loads:
            if op.req_id == req_id:
                for p in op.pieces:
                    out[p.tier] = out.get(p.tier, 0) + p.rows * self.block_size
        return out

    # -- saves ---------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> KVReelMetadata:
        # Last step's synchronous loads ran in its forward pass and their failures came
        # with its output: done. Block ids are reused, so a failure reported later is
        # another request's (async loads are done when the worker says so).
        for req_id in self._sync_loading:
            if (st := self.reqs.get(req_id)) is not None:
                st.load = None
        self._sync_loading = [op.req_id for op in self._loads if not op.is_async]
        for new in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.block_ids = tuple(list(ids) for ids in new.block_ids)
                self._plan_saves(st, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = tuple(list(ids or ()) for ids in new_ids) if new_ids else ()
            elif new_ids:
                st.block_ids = st.block_ids or tuple([] for _ in new_ids)
                for mine, ids in zip(st.block_ids, new_ids):
                    mine += ids or ()
            self._plan_saves(st, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        self._account_histories()
        self._plan_promotions()
        self._skip_zeroing_of_sync_loads(scheduler_output)
        meta = KVReelMetadata(self._loads, [op for op in self._stores.values() if op.tiers], self._evictions,
                              self.history.take_step() if self.history is not None else None,
                              self._plan_prefetches())
        for chunk in self._sync_pins:
            chunk.pins -= 1
        self._loads, self._stores, self._evictions = [], {}, {}
        self._sync_pins = []
        return meta

    def _account_histories(self) -> None:
        """Offloaded histories live in the worker's host memory, beside the host
        tier: charge them to its byte budget, so a growing session pushes the
        least recently used chunks out of host memory (their disk copies stay)
        and new chunks go to the disk tier only. A live history is never dropped:
        past the budget kvreel says so once and holds it anyway."""
        if self.history is None or self.cfg.cpu_bytes <= 0:
            return
        want = sum(self.history.planned.values()) * self.bytes_per_block
        grow = want - self._history_bytes
        if grow > 0:
            victims = self.host.victims_for(grow)
            if victims is None:
                victims = [c for c in self.host.lru.values() if c.pins == 0]
                if not self._warned_history_over_host:
                    self._warned_history_over_host = True
                    logger.warning("kvreel: long sessions' histories (%s) exceed KVREEL_CPU_BYTES (%s); "
                                   "host memory grows past it", format_bytes(want), format_bytes(self.cfg.cpu_bytes))
            for victim in victims:
                self._evict(victim, HOST)
        self.host.used += grow
        self._history_bytes = want

    def _plan_promotions(self) -> None:
        """Disk chunks loaded this step also go back into the host tier, room
        permitting. Done once every load of the step is planned (and its chunks
        pinned), so making room can never evict a chunk another request is
        about to load."""
        for op in self._loads:
            if not op.is_async:
                continue
            promoted = [c for c in self._async_pins.get(op.req_id, ())
                        if HOST not in c.tiers and c.key not in self.host.lru and self._admit(c, HOST, present=False)]
            for p in op.pieces:
                p.promote_to_host = any(c.key == p.key for c in promoted)
            self._promotions[op.req_id] = promoted

    # -- workflows (KVFlow) ----------------------------------------------------
    def _steps(self, chunk: Chunk) -> float:
        """Steps until the nearest agent that used ``chunk`` runs (FAR: unhinted)."""
        return min((self.workflows.steps(u) for u in chunk.users), default=FAR)

    def _use(self, chunk: Chunk, user: tuple[str, str]) -> None:
        """``user``'s prompt holds ``chunk``: it takes that agent's distance."""
        if len(chunk.users) < MAX_USERS:
            chunk.users.add(user)

    def _remember_prompt(self, st: RequestState) -> None:
        """What an agent's next request will most likely start with: the chunks
        of its last prompt (the prefetch target)."""
        request = st.request
        blocks = _prompt_blocks(request, self.block_size)
        chunks: OrderedDict[bytes, Chunk] = OrderedDict()
        for h in request.block_hashes[:blocks]:
            entry = self.index.get(h)
            if entry is not None:
                chunks[entry[0].key] = entry[0]
        self._agent_chunks[st.user] = chunks

    def _prefetch_source(self, chunk: Chunk) -> Tier | None:
        """Where a prefetch can read ``chunk`` from: its disk copy, or the remote
        store once it has left every local tier (uploaded when it was made)."""
        if self._indexed(chunk):
            return DISK if DISK in chunk.tiers else None
        if self.remote is not None and not any(h in self.index for h in chunk.block_hashes):
            return REMOTE
        return None

    def _indexed(self, chunk: Chunk) -> bool:
        return self.index.get(chunk.block_hashes[-1], (None,))[0] is chunk

    def _plan_prefetches(self) -> list[tuple[bytes, Tier]]:
        """Chunks of the agents about to run, read from disk or the remote store
        into the host tier in the background: nearest agent first, bounded in
        bytes in flight, and only into room held by chunks needed later."""
        if self.workflows is None or not self.cfg.prefetch_depth or self.cfg.cpu_bytes <= 0:
            return []
        out: list[tuple[bytes, Tier]] = []
        for user, steps in self.workflows.upcoming(self.cfg.prefetch_depth):
            chunks = self._agent_chunks.get(user, {})
            for key, chunk in list(chunks.items()):
                if key in self.host.lru or key in self._prefetching:
                    continue
                source = self._prefetch_source(chunk)
                if source is None:
                    if not self._indexed(chunk):
                        del chunks[key]              # gone, and nowhere to fetch it from
                    continue
                if self._prefetch_bytes + chunk.nbytes > self.cfg.prefetch_bytes:
                    return out
                victims = self.host.victims_for(chunk.nbytes, nearest=steps, strictly=True)
                if victims is None:
                    return out                       # host memory holds only nearer chunks
                for victim in victims:
                    self._evict(victim, HOST)
                self.host.add(chunk)                 # reserved; present once every worker has it
                chunk.pins += 1
                self._prefetching[key] = chunk
                self._prefetch_bytes += chunk.nbytes
                self.stats.add("prefetches", label="issued")
                out.append((key, source))
        return out

    def _prefetch_done(self, key: bytes, ok: bool) -> None:
        chunk = self._prefetching.pop(key, None)
        self._prefetch_landed.pop(key, None)
        if chunk is None:
            return
        chunk.pins -= 1
        self._prefetch_bytes -= chunk.nbytes
        if ok and (self._indexed(chunk) or not any(h in self.index for h in chunk.block_hashes)):
            chunk.tiers.add(HOST)
            chunk.prefetched = True
            self._index(chunk)                       # a chunk fetched back from the remote store
        else:
            self.host.remove(chunk)
            self._evictions.setdefault(HOST, []).append(key)   # a worker may hold it
            if not ok:
                self.stats.add("prefetches", label="failed")
                for user in chunk.users:                  # not asked for again
                    self._agent_chunks.get(user, {}).pop(key, None)

    def _skip_zeroing_of_sync_loads(self, scheduler_output) -> None:
        """Blocks a host load overwrites completely before the forward pass need
        not be zeroed first (the one change to scheduler_output vLLM allows
        synchronous loaders); a failed load is recomputed, which rewrites every
        position of these full blocks."""
        to_zero = scheduler_output.new_block_ids_to_zero
        if not to_zero:
            return
        loaded = {b for op in self._loads if not op.is_async for p in op.pieces for b in p.block_ids[0]}
        if loaded:
            scheduler_output.new_block_ids_to_zero = [b for b in to_zero if b not in loaded] or None

    def _plan_saves(self, st: RequestState, computed_after: int) -> None:
        """Store the request's full blocks computed by the end of this step.

        Every full block is stored in the step that computes it (prompt and
        generated tokens alike), grouped into chunks that never cross a chunk
        boundary. Storing at once means vLLM never has to keep a finished
        request's blocks alive for a late save, so kvreel does not change
        vLLM's scheduling."""
        if not st.block_ids:
            return
        if self.history is not None:
            self.history.plan(st.request.request_id, computed_after, st.block_ids[0])
        hashes = st.request.block_hashes
        full = min(computed_after // self.block_size, len(hashes), *(len(ids) for ids in st.block_ids))
        i = st.saved_upto
        if self.history is not None:        # blocks vLLM freed (kvreel holds them): their ids are someone else's now
            i = max(i, self.history.held(st.request.request_id))
        while i < full:
            if hashes[i] in self.index or not self._held_by_every_group(st, i):
                i += 1
                continue
            j = i
            boundary = (i // self.chunk_blocks + 1) * self.chunk_blocks
            while j < min(full, boundary) and hashes[j] not in self.index and self._held_by_every_group(st, j):
                j += 1
            user = st.user if i < _prompt_blocks(st.request, self.block_size) else None  # prompts, not answers
            self._new_chunk(list(hashes[i:j]), tuple(ids[i:j] for ids in st.block_ids), st.from_remote, user)
            i = j
        st.saved_upto = max(st.saved_upto, full)

    @staticmethod
    def _held_by_every_group(st: RequestState, position: int) -> bool:
        """A block is stored only whole: a sliding-window group may hold a
        position (a prefix vLLM found in its own cache) only as NULL_BLOCK."""
        return all(ids[position] != NULL_BLOCK for ids in st.block_ids)

    def _new_chunk(self, block_hashes: list[bytes], block_ids: GroupBlockIds, from_remote: set,
                   user: tuple[str, str] | None = None) -> None:
        chunk = Chunk(block_hashes[-1], block_hashes, len(block_hashes) * self.bytes_per_block)
        if user is not None:
            self._use(chunk, user)
        op = StoreOp(chunk.key, block_hashes, block_ids, set())
        self._stores[chunk.key] = op        # before admitting: an eviction on the way updates it
        if self.cfg.cpu_bytes > 0 and self._admit(chunk, HOST):
            op.tiers.add(HOST)
        if DISK in self.budgets and self._admit(chunk, DISK):
            op.tiers.add(DISK)
        if self.remote is not None and not all(h in from_remote for h in block_hashes):
            op.tiers.add(REMOTE)
        if chunk.tiers:
            self._index(chunk)
        for tier in op.tiers:
            self.stats.add("saved_bytes", chunk.nbytes, tier)

    # -- tiers ---------------------------------------------------------------
    def _index(self, chunk: Chunk) -> None:
        for row, h in enumerate(chunk.block_hashes):
            self.index[h] = (chunk, row)

    def _admit(self, chunk: Chunk, tier: Tier, present: bool = True) -> bool:
        """Make room (evicting LRU chunks) and account ``chunk`` in a local tier;
        ``present=False`` reserves the room for a copy still on its way (a
        promotion), which lookups may use once it has landed."""
        budget = self.budgets[tier]
        victims = budget.victims_for(chunk.nbytes, self._steps(chunk) if budget.steps else 0)
        if victims is None:
            return False
        for victim in victims:
            self._evict(victim, tier)
        budget.add(chunk)
        if present:
            chunk.tiers.add(tier)
        return True

    def _evict(self, chunk: Chunk, tier: Tier) -> None:
        self._drop_copy(chunk, tier)
        pending = self._stores.get(chunk.key)
        if pending is not None:
            pending.tiers.discard(tier)        # not written yet: nothing to delete
        else:
            self._evictions.setdefault(tier, []).append(chunk.key)
        self.stats.add("evicted_chunks", label=tier)

    def _drop_copy(self, chunk: Chunk, tier: Tier) -> None:
        """Account a copy gone from a tier; a chunk in no local tier is forgotten."""
        self.budgets[tier].remove(chunk)
        chunk.tiers.discard(tier)
        if tier == HOST and chunk.prefetched:
            chunk.prefetched = False
            self.stats.add("prefetches", label="wasted")
        if not chunk.tiers:
            for h in chunk.block_hashes:
                if self.index.get(h, (None,))[0] is chunk:
                    del self.index[h]

    def _drop(self, key: bytes) -> None:
        """Forget a chunk everywhere (it failed verification)."""
        entry = self.index.get(key)
        if entry is None or entry[0].key != key:
            return
        chunk = entry[0]
        for tier in list(chunk.tiers):
            self._evict(chunk, tier)

    # -- feedback from the workers -------------------------------------------
    def update_connector_output(self, output) -> None:
        if self.history is not None:
            self.history.confirm()
        if output.failed_recving or output.invalid_block_ids:
            self._recomputed(set(output.failed_recving or ()), set(output.invalid_block_ids or ()))
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVReelWorkerMeta):
            disk = self.budgets.get(DISK)
            if meta.disk_disabled and disk is not None:
                logger.error("kvreel: disk tier disabled by a worker: %s", meta.disk_disabled)
                for chunk in list(disk.lru.values()):
                    self._drop_copy(chunk, DISK)     # the copies are gone: no deletes to send
                del self.budgets[DISK]
            for key in meta.failed_disk_keys:
                self.stats.add("disk_write_failures")
                entry = self.index.get(key)
                if entry and DISK in self.budgets and DISK in entry[0].tiers:
                    self._drop_copy(entry[0], DISK)
            for key in meta.bad_keys:
                self._drop(key)
            for key, n in meta.prefetched.items():
                self._prefetch_landed[key] = self._prefetch_landed.get(key, 0) + n
                if self._prefetch_landed[key] >= self.workers:
                    self._prefetch_done(key, True)
            for key in meta.prefetch_failed:
                self._prefetch_done(key, False)
        for req_id in output.finished_recving or ():
            if (st := self.reqs.get(req_id)) is not None:
                st.load = None
            for chunk in self._async_pins.pop(req_id, ()):
                chunk.pins -= 1
            for chunk in self._promotions.pop(req_id, ()):
                if chunk.key in self.host.lru and self._indexed(chunk):
                    chunk.tiers.add(HOST)

    def _recomputed(self, failed_requests: set[str], invalid_blocks: set[int]) -> None:
        """Requests whose load failed are recomputed by vLLM (whole, or from the
        first failed block): what they compute then is stored anew."""
        for req_id, st in self.reqs.items():
            if st.load is not None and (req_id in failed_requests or st.load[1] & invalid_blocks):
                st.saved_upto = min(st.saved_upto, st.load[0])
                st.load = None

    def request_finished(self, request) -> None:
        st = self.reqs.pop(request.request_id, None)
        if self.workflows is not None:
            if st is not None and st.user is not None:
                self._remember_prompt(st)
            self.workflows.on_finished(request.request_id)
        self._planned.pop(request.request_id, None)
        self._history_skip.pop(request.request_id, None)
        if self.history is not None:
            self.history.forget(request.request_id)
        self._remote_plans.pop(request.request_id, None)
        if self.remote is not None:
            self.remote.forget(request.request_id)

    def reset(self) -> bool:
        """Forget every unpinned chunk in every tier (``reset_prefix_cache(reset_connector=True)``)."""
        for tier, budget in list(self.budgets.items()):
            for chunk in [c for c in budget.lru.values() if c.pins == 0]:
                self._evict(chunk, tier)
        return True

    def take_stats(self) -> KVReelStats | None:
        return self.stats.take()
