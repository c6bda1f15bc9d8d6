"""Load planning: how much of a request's prefix kvreel holds (vLLM's lookup
hook), then, once vLLM has allocated its blocks, which pieces of which chunks
each tier restores into them; the pins that keep those chunks in place until
the load is done; disk chunks promoted back into host memory on the way."""

from __future__ import annotations

from kvreel.connector.metadata import GroupBlockIds, HistoryPiece, LoadOp, LoadPiece
from kvreel.scheduler.chunks import DISK, HOST, REMOTE, Chunk, ChunkStore
from kvreel.scheduler.requests import PendingLoad, RequestState
from kvreel.connector.tiers import Tier


class LoadPlanner:
    def __init__(self, store: ChunkStore, block_size: int, blocking: bool, loads_by_request: bool,
                 remote=None, history=None):
        self.store, self.block_size = store, block_size
        self.blocking = blocking                    # KVREEL_FETCH_MODE=blocking: every load in the forward pass
        self.loads_by_request = loads_by_request    # vLLM maps failed loads to requests only, not block ids
        self.remote, self.history = remote, history
        self.loads: list[LoadOp] = []               # this step's
        self._sync_pins: list[Chunk] = []
        self._sync_loading: list[str] = []          # requests whose synchronous load runs in this step
        self._async_pins: dict[str, list[Chunk]] = {}
        self._promotions: dict[str, list[Chunk]] = {}

    # -- vLLM's lookup ----------------------------------------------------------------
    def lookup(self, st: RequestState, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens kvreel can load beyond
        ``num_computed_tokens``, and whether the load runs in the background
        (None: a remote lookup is still in flight, ask again next step)."""
        request, index, bs = st.request, self.store.index, self.block_size
        hashes = request.block_hashes
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        n = 0
        while n < limit and hashes[n] in index:
            n += 1
        held_from_zero = n
        if st.user is not None:
            for h in hashes[:n]:
                index[h].chunk.used_by(st.user)
        start = num_computed_tokens // bs
        self._cached_by_vllm(st, start)
        n = max(n, start)               # blocks below `start` are in vLLM's own cache already
        local_end = n
        st.pending = None
        found: list[tuple[bytes, int]] = []
        if self.remote is not None and n < limit:
            found = self.remote.poll(request.request_id, hashes[n:limit])
            if found is None:
                return None, False      # lookup in flight: vLLM asks again next step
            if self.history is not None and self.history.window_start((n + len(found)) * bs) > n:
                # A long request's blocks outside its window go into its history, which loads
                # from the local tiers only; remote blocks there would be loaded into vLLM's
                # cache and could fill it with one request that then cannot run (the soak
                # found that deadlock). They are recomputed, leaving vLLM's cache as they go.
                found = []
            n += len(found)
        if not st.counted_lookup and limit > n:
            st.counted_lookup = True
            self.store.stats.add("lookup_miss_blocks", limit - n)
        skip = 0
        if self.history is not None:
            # a long prefix kvreel holds from block 0 comes into the history, not into vLLM's cache
            # (only with something to load: the history arrives with the request's other loads)
            held = min(held_from_zero, local_end) if n > start and not self.blocking else 0
            skip = self.history.admission_skip(request.request_id, n * bs, held)
        if n <= start:
            return 0, False
        st.pending = PendingLoad(start, local_end, found, skip)
        needs_async = n > local_end or skip > 0 or self.loads_by_request or \
            any(HOST not in index[h].chunk.tiers for h in hashes[start:local_end])
        return (n - start) * bs, needs_async and not self.blocking

    def _cached_by_vllm(self, st: RequestState, start: int) -> None:
        """Blocks ``[0, start)`` came from vLLM's own cache: they were stored
        when first computed, so they are not stored again (a multi-turn chat
        would otherwise copy its whole history every turn, wherever kvreel
        evicted it); the chunks kvreel holds of them count as used now, so a
        prefix vLLM keeps hitting stays in kvreel's tiers too."""
        st.saved_upto = st.cached_blocks = start
        index, last = self.store.index, None
        for h in st.request.block_hashes[:start]:
            ref = index.get(h)
            if ref is not None and ref.chunk is not last:
                last = ref.chunk
                self.store.touch(last)

    # -- vLLM allocated the blocks ----------------------------------------------------------
    def plan(self, st: RequestState, block_ids: GroupBlockIds, num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the request's load, piece by piece."""
        pending, st.pending = st.pending, None
        if num_external_tokens == 0 or pending is None:
            return
        request = st.request
        start, first_remote = pending.start, pending.local_end
        end = start + num_external_tokens // self.block_size
        pieces: list[LoadPiece] = []
        chunks: list[Chunk] = []
        history = self._history_pieces(request, pending.history_skip, chunks)
        for i in range(max(start, pending.history_skip), end):
            if i >= first_remote:
                key, row = pending.remote[i - first_remote]
                last = pieces[-1] if pieces else None
                if last and last.extends(key, row):
                    last.append(block_ids, i)
                else:
                    pieces.append(LoadPiece.at(key, REMOTE, row, block_ids, i))
                st.from_remote.add(request.block_hashes[i])
                continue
            chunk, row = self.store.index[request.block_hashes[i]]
            tier = HOST if HOST in chunk.tiers else DISK
            last = pieces[-1] if pieces else None
            if last and last.extends(chunk.key, row):
                last.append(block_ids, i)
                continue
            pieces.append(LoadPiece.at(chunk.key, tier, row, block_ids, i))
            self._pin(chunk, chunks, tier)
        for p in pieces:
            self.store.stats.add("lookup_hit_blocks", p.rows, p.tier)
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
        self.loads.append(LoadOp(request.request_id, pieces, is_async, history))
        if self.history is not None:
            self.history.admitted(request.request_id, pending.history_skip)

    def _pin(self, chunk: Chunk, chunks: list[Chunk], tier: Tier) -> None:
        """A chunk a load reads from: pinned once per load (no eviction under it), and recently used."""
        if chunk not in chunks:
            chunks.append(chunk)
            chunk.pins += 1
            self.store.touch(chunk)
            if chunk.prefetched and tier == HOST:
                chunk.prefetched = False
                self.store.stats.add("prefetches", label="used")

    def _history_pieces(self, request, skip: int, chunks: list[Chunk]) -> list[HistoryPiece]:
        """Blocks ``[0, skip)`` of an admitted long prefix, from kvreel's local
        tiers into the request's history (their chunks pinned with the rest)."""
        pieces: list[HistoryPiece] = []
        for i in range(skip):
            chunk, row = self.store.index[request.block_hashes[i]]
            tier = HOST if HOST in chunk.tiers else DISK
            last = pieces[-1] if pieces else None
            if last and last.key == chunk.key and last.first + last.n == row:
                last.n += 1
                continue
            pieces.append(HistoryPiece(chunk.key, tier, row, 1, i))
            self._pin(chunk, chunks, tier)
        for p in pieces:
            self.store.stats.add("lookup_hit_blocks", p.n, p.tier)
        return pieces

    def tokens_by_tier(self, req_id: str) -> dict[Tier, int]:
        """Tokens of this step's load for ``req_id``, per tier (vLLM's hit-source metrics)."""
        out: dict[Tier, int] = {}
        for op in self.loads:
            if op.req_id == req_id:
                for p in op.pieces:
                    out[p.tier] = out.get(p.tier, 0) + p.rows * self.block_size
        return out

    # -- the step's metadata ------------------------------------------------------------
    def begin_step(self, reqs: dict[str, RequestState]) -> None:
        """Last step's synchronous loads ran in its forward pass and their failures
        came with its output: done. Block ids are reused, so a failure reported
        later is another request's (async loads are done when the worker says so)."""
        for req_id in self._sync_loading:
            if (st := reqs.get(req_id)) is not None:
                st.load = None
        self._sync_loading = [op.req_id for op in self.loads if not op.is_async]

    def plan_promotions(self) -> None:
        """Disk chunks loaded this step also go back into the host tier, room
        permitting. Done once every load of the step is planned (and its chunks
        pinned), so making room can never evict a chunk another request is
        about to load."""
        host = self.store.host
        for op in self.loads:
            if not op.is_async:
                continue
            promoted = [c for c in self._async_pins.get(op.req_id, ())
                        if HOST not in c.tiers and c.key not in host.lru and self.store.admit(c, HOST, present=False)]
            for p in op.pieces:
                p.promote_to_host = any(c.key == p.key for c in promoted)
            self._promotions[op.req_id] = promoted

    def skip_zeroing(self, scheduler_output) -> None:
        """Blocks a host load overwrites completely before the forward pass need
        not be zeroed first (the one change to scheduler_output vLLM allows
        synchronous loaders); a failed load is recomputed, which rewrites every
        position of these full blocks."""
        to_zero = scheduler_output.new_block_ids_to_zero
        if not to_zero:
            return
        loaded = {b for op in self.loads if not op.is_async for p in op.pieces for b in p.block_ids[0]}
        if loaded:
            scheduler_output.new_block_ids_to_zero = [b for b in to_zero if b not in loaded] or None

    def take_step(self) -> list[LoadOp]:
        """This step's loads, handed to the workers; synchronous loads unpin their chunks now."""
        loads, self.loads = self.loads, []
        for chunk in self._sync_pins:
            chunk.pins -= 1
        self._sync_pins = []
        return loads

    # -- what the workers said -------------------------------------------------------------
    def finished(self, req_id: str, st: RequestState | None) -> None:
        """A background load is done: its chunks are free to go, its promotions have landed."""
        if st is not None:
            st.load = None
        for chunk in self._async_pins.pop(req_id, ()):
            chunk.pins -= 1
        for chunk in self._promotions.pop(req_id, ()):
            if chunk.key in self.store.host.lru and self.store.indexed(chunk):
                self.store.hold(chunk, HOST)

    @staticmethod
    def recomputed(reqs: dict[str, RequestState], failed_requests: set[str], invalid_blocks: set[int]) -> None:
        """Requests whose load failed are recomputed by vLLM (whole, or from the
        first failed block): what they compute then is stored anew, into the
        remote store too (a chunk it failed to serve may be gone or refused)."""
        for req_id, st in reqs.items():
            if st.load is not None and (req_id in failed_requests or st.load[1] & invalid_blocks):
                st.saved_upto = min(st.saved_upto, st.load[0])
                st.from_remote.clear()
                st.load = None
