"""Retrieval attention in a worker process: the long sessions' histories, their
working sets, the DRE, and what each layer attends to.

A request is *long* once kvreel holds part of its history (blocks that left its
local window; ``kvreel.connector.retrieval.offload`` frees them in vLLM). For
a long request every layer attends, with vLLM's own CPU kernel, to a
*working set*: pages holding the sink block and the history tokens chosen for
this layer and step, followed by the request's blocks still in vLLM's cache
(window and the step's own tokens), copied behind them. Keys are post-RoPE,
so where a token sits in the working set changes nothing but summation order;
every history token precedes every query, so causal masking is unchanged.

What each layer keeps:

* exact (``KVREEL_RETRIEVAL_BUDGET_SHARE=1`` and a budget of tokens that holds
  the history): every history token in token order, so attention is
  bit-identical to vLLM's over its own cache;
* otherwise, every step and layer scores the history with the step's own
  queries, in the worker, and keeps the tokens they want most
  (``select_tokens``: per query row, so the few rows that look for a needle
  get it) up to the budget (``KVREEL_RETRIEVAL_BUDGET_SHARE`` of the history,
  at most ``KVREEL_RETRIEVAL_BUDGET_TOKENS``) or until every row holds
  ``alpha`` of its mass. Nothing waits and nothing is stale: the first token
  after a prompt attends to what its own query asks for.

A decoding step (or a chunk of at most ``KVREEL_RETRIEVAL_ROWS_PER_SET``
tokens: one working set) keeps whole blocks (``choose_blocks``): it scores
exactly the tokens of the blocks its own queries rank best by their keys'
channel-wise bounds (Quest), ``KVREEL_RETRIEVAL_DECODE_CANDIDATES`` (2) times
the budget, once the history is twice that, and keeps the blocks that hold
most of its rows' attention, copied as vLLM packed them. Ranking blocks costs
a step what the history's blocks number, not its tokens, so decoding need not
read every key as full attention does, and the copy needs no repacking.
A prefill chunk's rows (many, with different wants, crowding so few
candidates) score all tokens, exactly, while the history is less than twice
``KVREEL_RETRIEVAL_CANDIDATES`` times the budget; past that, the DRE's
clusters narrow them first: every cluster is ranked by its centroid and only
the tokens of the best ones (that many times the budget) are scored exactly
(``LayerHistory.candidates``, through a per-head index of each cluster's
tokens), so a step scores a bounded number of tokens and ranks clusters, not
tokens. With ``KVREEL_RETRIEVAL_NARROWING=pages`` blocks are ranked instead by
their keys' channel-wise bounds (Quest), in the worker, and no DRE runs.
The DRE does the clustering, off the critical path (ReSV's hash bits, or
Mosaic's nested k-means with online assignment and splits); tokens it has
not labelled yet are always candidates, so a DRE that is late or down costs
time, never a stale choice (steps taken while it is gone count as
``dre_down``).

Threads: histories and working sets belong to the thread that runs the model
(attention, ``begin_step``, ``append_history``, labels applied from
``DRELink``); vLLM's stats thread takes the counters under ``_stats_lock``."""

from __future__ import annotations

import math
import threading

import torch

from kvreel.connector import freed_memory
from kvreel.connector.config import KVReelConfig
from kvreel.connector.retrieval.dre_link import DRELink
from kvreel.connector.retrieval.history import RequestHistory
from kvreel.connector.retrieval.scoring import Scratch
from kvreel.connector.retrieval.page_packing import PagePacking
from kvreel.connector.retrieval.selection import choose_blocks, choose_tokens_in_groups, kept_tokens, narrows
from kvreel.connector.retrieval.working_set import SlotBuffers, WorkingSet
from kvreel.connector.stats import KVReelStats, register_stats_source
from kvreel.connector.vllm_internals import cpu_attn_isa, layer_index


class RetrievalRuntime:
    """One per worker process: histories, working sets, the link to the DRE.

    Its owner is the engine's model: the first attention layer kvreel's backend
    builds makes it (``for_layers``; the others share it), since vLLM builds
    the model before the KV connector; the connector's worker then takes it
    (``built``) and hands it the engine's caches."""

    _built: "RetrievalRuntime | None" = None
    _lock = threading.Lock()

    @classmethod
    def for_layers(cls, cfg: KVReelConfig) -> "RetrievalRuntime":
        """The runtime of this process's attention layers, made with ``cfg`` (the
        engine's settings) by the first of them."""
        with cls._lock:
            if cls._built is None:
                cls._built = cls(cfg)
            return cls._built

    @classmethod
    def built(cls) -> "RetrievalRuntime | None":
        """The runtime the attention layers made; None where none did (an engine
        whose attention is not kvreel's)."""
        return cls._built

    def __init__(self, cfg: KVReelConfig):
        self.cfg = cfg
        self.histories: dict[str, RequestHistory] = {}
        self.rows: dict[int, str] = {}            # this step: block id of a row's newest token -> request
        self.step_memo: dict[int, tuple[object, dict]] = {}     # what a step's layers share (the backend's)
        self.working: dict[tuple[str, int], WorkingSet] = {}
        self.slots: SlotBuffers | None = None      # every layer's working-set buffer, a slot per long request
        self.caches: dict[int, torch.Tensor] = {}  # layer -> the engine's cache [blocks, H, 2 bs, D]
        self.packing: PagePacking | None = None
        self._temporaries = Scratch()     # a step's temporaries: scored keys, scoring passes, grouped pages
        self.resident_pages = 0
        self.max_batched_tokens = 0
        self.stats = KVReelStats()
        self._stats_lock = threading.Lock()
        register_stats_source(self.take_stats)
        self.dre = DRELink(cfg, self.count)

    # -- set-up -----------------------------------------------------------------------
    def configure_engine(self, vllm_config) -> None:
        """Note the engine's step size (attention impls are built with its config current)."""
        self.max_batched_tokens = self.max_batched_tokens or vllm_config.scheduler_config.max_num_batched_tokens

    def register_caches(self, kv_caches: dict[str, torch.Tensor], spec, max_batched_tokens: int) -> None:
        """The engine's per-layer caches (the connector hands them over) and their geometry."""
        self.heads, self.head_dim, self.block_size = spec.num_kv_heads, spec.head_size, spec.block_size
        self.dtype = spec.dtype
        for name, cache in kv_caches.items():
            layer = layer_index(name)
            if layer is not None:
                self.caches[layer] = cache.view(cache.shape[0], self.heads, 2 * self.block_size, self.head_dim)
        self.num_layers = len(self.caches)
        self.packing = PagePacking(self.block_size, self.head_dim, self.dtype,
                                   cpu_attn_isa(self.dtype, self.block_size, self.head_dim))
        self.budget_pages = max(2, self.cfg.retrieval_budget_tokens // self.block_size)
        # resident: the window, the blocks not yet confirmed in the history (one step) and the step's own
        self.resident_pages = -(-(self.cfg.retrieval_window + 2 * max_batched_tokens) // self.block_size) + 3
        self.slots = SlotBuffers(self.num_layers, (self.heads, 2 * self.block_size, self.head_dim), self.dtype,
                                 self.slot_pages)

    def count(self, name: str, value: float = 1, label: str | None = None) -> None:
        with self._stats_lock:
            self.stats.add(name, value, label)

    def take_stats(self) -> KVReelStats | None:
        with self._stats_lock:
            return self.stats.take()

    # -- the connector's per-step calls -----------------------------------------------------
    def begin_step(self, rows: dict[int, str], dropped: list[str]) -> None:
        for req_id in dropped:
            self.drop(req_id)
        self.rows = rows
        self.step_memo = {}

    @property
    def slot_pages(self) -> int:
        return self.budget_pages + self.resident_pages

    def buffer(self, layer: int) -> torch.Tensor:
        return self.slots.buffers[layer]

    def drop(self, req_id: str) -> None:
        hist = self.histories.pop(req_id, None)
        if hist is not None:
            freed_memory.freed(hist.reserved_bytes)
        if self.slots is not None:
            self.slots.release(req_id)
        for layer in range(getattr(self, "num_layers", 0)):
            self.working.pop((req_id, layer), None)
            self.dre.drop(req_id, layer)

    def append_history(self, req_id: str, first_block: int, block_ids: list[int], room_blocks: int = 0,
                       most_blocks: int = 0, reach_blocks: int = 0) -> None:
        """Blocks ``first_block...`` of a request leave its window: copy their
        pages out of the engine's cache into the history (after the step that
        computed them; vLLM frees them once the scheduler has heard back). Its
        history is expected to reach ``room_blocks`` (its prompt and the start of
        its answer): room for them is reserved at once (``most_blocks``: the most a
        decoding history that may outgrow them can reach; ``reach_blocks``: the most
        any can, 0 where unknown)."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        self.add_history(req_id, first_block, [self.caches[layer].index_select(0, ids)
                                               for layer in range(self.num_layers)], room_blocks, most_blocks,
                         reach_blocks)

    @torch.inference_mode()
    def add_history(self, req_id: str, first_block: int, pages: list[torch.Tensor], room_blocks: int = 0,
                    most_blocks: int = 0, reach_blocks: int = 0) -> None:
        """Pages ``[n, H, 2 bs, D]`` per layer of blocks ``first_block...`` (from the
        engine's cache, or loaded from kvreel's tiers) join the request's history
        (room for ``room_blocks`` reserved; ``most_blocks``: ``RequestHistory.append``;
        ``reach_blocks``: the most it can reach, 0 where unknown)."""
        hist = self.histories.get(req_id)
        if hist is None:
            if first_block != 0:
                raise ValueError(f"history of {req_id} must start at block 0, not {first_block}")
            hist = self.histories[req_id] = RequestHistory(self.num_layers, self.heads, self.block_size,
                                                           self.head_dim, self.dtype, self.packing)
        if first_block != hist.num_blocks:
            raise ValueError(f"history of {req_id} holds {hist.num_blocks} blocks, got blocks from {first_block}")
        hist.reach_blocks = max(hist.reach_blocks, reach_blocks)
        # unless it is all kept, the DRE's tables grow with the history: its clusters narrow long ones
        client = self.dre.client() if self.clusters_for(hist, extra=pages[0].shape[0]) else None
        first_token = max(first_block, 1) * self.block_size
        keys = hist.append(pages, room_blocks * self.block_size, most_blocks * self.block_size)
        for layer, layer_keys in enumerate(keys):
            if client is not None and layer_keys.shape[1]:
                self.dre.send(client, req_id, layer, hist.layers[layer], layer_keys, first_token,
                              self.working.get((req_id, layer)))

    def as_pages(self, rows: torch.Tensor) -> torch.Tensor:
        """One layer's rows of a stored chunk ``[n, block_bytes]`` (uint8) as cache pages ``[n, H, 2 bs, D]``."""
        return rows.contiguous().view(self.dtype).view(rows.shape[0], self.heads, 2 * self.block_size,
                                                       self.head_dim)

    def exact_for(self, hist: RequestHistory, extra: int = 0) -> bool:
        """Whether every history page (plus ``extra`` more) is within the budget: then
        all are attended to, in token order, with nothing to select."""
        return self.cfg.retrieval_budget_share >= 1 and hist.num_blocks + extra <= self.budget_pages

    def clusters_for(self, hist: RequestHistory, extra: int = 0) -> bool:
        """Whether this request's history needs the DRE's clusters: they narrow it
        now, or will before it is twice as long (so they are ready in time), if it
        can grow that long (the most its request can reach, where the scheduler
        said): a request that never reaches the narrowing length keeps the DRE idle."""
        blocks = 2 * (hist.num_blocks + extra)
        if hist.reach_blocks:
            blocks = min(blocks, max(hist.reach_blocks, hist.num_blocks + extra))
        return self.cfg.retrieval_narrowing == "clusters" and not self.exact_for(hist, extra) and \
            narrows(self.cfg.retrieval_candidates, self.kept_tokens(blocks), (blocks - 1) * self.block_size)

    def kept_tokens(self, blocks: int) -> int:
        """History tokens a layer attends to beside the sink block, for a history of ``blocks`` blocks."""
        return kept_tokens(self.cfg.retrieval_budget_share, self.cfg.retrieval_budget_tokens, self.block_size, blocks)

    # -- attention ----------------------------------------------------------------------
    def working_set(self, req_id: str, layer: int, queries: torch.Tensor) -> WorkingSet:
        """The working set of this (request, layer) for a step of at most one set's
        rows (a decoding step): the sink block and the history its own queries
        ``[H, R, D]`` want most, in whole blocks (``choose_blocks``), or with
        ``KVREEL_RETRIEVAL_DECODE_CANDIDATES=0`` in tokens as a prefill group
        chooses them (``choose_tokens``)."""
        hist = self.histories[req_id]
        ws = self.working.get((req_id, layer))
        if ws is None:
            slot = self.slots.slot(req_id, self.working)
            ws = self.working[(req_id, layer)] = WorkingSet(self.slots.view(layer, slot), slot, self.heads,
                                                             self.budget_pages * self.block_size)
        if self.exact_for(hist):
            ws.hold_in_order(hist.layers[layer])
            self.count("retrieval_steps", label="exact")
            return ws
        lh = hist.layers[layer]
        if self.cfg.retrieval_decode_candidates:
            dre_down = self._ask_dre(req_id, layer)
            tally: dict = {}
            blocks = choose_blocks(lh, queries, self.cfg.retrieval_alpha, self.kept_tokens(hist.num_blocks),
                                   self.cfg.retrieval_decode_candidates, self._temporaries, tally)
            self.count_choice(hist, "dre_down" if dre_down else "selected", blocks.shape[1], tally)
            ws.hold_blocks(lh, blocks)
        else:
            ws.hold(lh, self.choose_in_groups(req_id, layer, queries, queries.shape[1])[0])
        return ws

    def choose_in_groups(self, req_id: str, layer: int, queries: torch.Tensor, group_rows: int) -> list[torch.Tensor]:
        """For every run of ``group_rows`` of the query rows ``[H, R, D]`` (a group
        of a prefill chunk's tokens), the history tokens it attends to ``[H, bs + m]``
        (``choose_tokens_in_groups``)."""
        hist = self.histories[req_id]
        dre_down = self._ask_dre(req_id, layer)
        tally: dict = {}
        chosen = choose_tokens_in_groups(hist.layers[layer], queries, group_rows, self.cfg.retrieval_alpha,
                                         self.kept_tokens(hist.num_blocks), self.cfg.retrieval_candidates,
                                         self.cfg.retrieval_narrowing, self._temporaries, tally)
        for tokens in chosen:
            self.count_choice(hist, "dre_down" if dre_down else "selected", tokens.shape[1] // self.block_size,
                              tally)
            tally = {}                         # the call's scoring counts once, not per group
        return chosen

    def _ask_dre(self, req_id: str, layer: int) -> bool:
        """The DRE's new labels applied, and a history that needs its clusters but
        has none sent to it; whether it needs them while the DRE is down."""
        self.dre.take_labels(self.histories)
        hist = self.histories[req_id]
        clustered = self.clusters_for(hist)
        client = self.dre.client() if clustered else None
        if client is not None and not self.dre.holds(req_id, layer):                  # a new DRE: cluster anew
            lh = hist.layers[layer]
            self.dre.send(client, req_id, layer, lh, lh.dre_keys(), self.block_size, self.working.get((req_id, layer)))
        return clustered and client is None

    def count_choice(self, hist: RequestHistory, outcome: str, kept_blocks: int, tally: dict) -> None:
        with self._stats_lock:            # once per layer-step: one lock for them all
            self.stats.add("retrieval_steps", label=outcome)
            self.stats.add("retrieval_history_blocks", hist.num_blocks)
            self.stats.add("retrieval_kept_blocks", kept_blocks)
            for by, tokens in tally.items():
                self.stats.add("retrieval_scored_tokens", tokens, by)

    def reserved_bytes(self) -> int:
        """Bytes every history takes: what it holds, the room it may grow into, its
        clusters' key sums (which grow with the DRE's labels), and the DRE's tables
        of them where the DRE runs on this host."""
        return sum(h.reserved_bytes for h in list(self.histories.values())) + self.dre.table_bytes()

    def memory(self) -> dict[str, int]:
        """Bytes held in this worker, by part: the long requests' histories (their
        KV and keys, then every tensor with the room reserved to grow into), the
        working-set buffers, and the steps' temporaries; and the DRE's tables (in
        its own process)."""
        return {"history": sum(h.nbytes for h in self.histories.values()),
                "history_reserved": sum(h.reserved_bytes for h in self.histories.values()),
                "dre_tables": self.dre.table_bytes(),
                "working_sets": self.slots.nbytes if self.slots is not None else 0,
                "temporaries": self._temporaries.nbytes}

    def scratch(self, pages: int) -> torch.Tensor:
        """``pages`` cache pages ``[pages, H, 2 bs, D]`` for one kernel call's working
        sets (a prefill chunk's groups), reused by every layer and step: kept, not
        allocated per call (``Scratch``)."""
        shape = (pages, self.heads, 2 * self.block_size, self.head_dim)
        return self._temporaries.take("pages", math.prod(shape), self.dtype).view(shape)
