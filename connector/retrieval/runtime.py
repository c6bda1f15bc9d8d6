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

Which tokens are scored: all of them, exactly, while the history is at most
``KVREEL_RETRIEVAL_CANDIDATES`` times the budget; past that, the DRE's
clusters narrow them first: every cluster is ranked by its centroid and only
the tokens of the best ones (that many times the budget) are scored exactly
(``LayerHistory.candidates``), so a step's cost stops growing with the
history. The DRE does the clustering, off the critical path (ReSV's hash
bits, or Mosaic's nested k-means with online assignment and splits); tokens
it has not labelled yet are always candidates, so a DRE that is late or down
costs time, never a stale choice (steps taken while it is gone count as
``dre_down``)."""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import math
import re
import tempfile
import threading
from concurrent.futures import Future

import torch

from kvreel.connector.config import KVReelConfig
from kvreel.connector.retrieval.dre_service import DREClient, DREError, DREProcess
from kvreel.connector.retrieval.history import LayerHistory, RequestHistory
from kvreel.connector.retrieval.page_packing import PagePacking
from kvreel.connector.stats import KVReelStats, register_stats_source

logger = logging.getLogger(__name__)
ROWS_AT_ONCE = 32            # query rows scored together


def select_tokens(queries: torch.Tensor, keys: torch.Tensor, alpha: float, count: int, unit: int) -> torch.Tensor:
    """Per KV head, indices ``[H, m]`` into the ``n`` scored tokens (keys ``[H, n, D]``)
    to attend to, for query rows ``[H, R, D]``.

    Each row spreads its attention over the tokens (softmax of ``q . k / sqrt D``),
    and a token ranks by the largest share any one row gives it: the few rows
    of a prefill chunk that ask for a needle get it, whatever the chunk's other
    rows want (an average over the rows would drown them). Tokens are taken in
    that order until every row holds ``alpha`` of its mass (WiCSum, per row) or
    ``count``; ``m`` is a whole number of pages (``unit`` tokens), the same for
    every head (the kernel's pages per row)."""
    H, R, _ = queries.shape
    k = min(count, keys.shape[1])
    if k <= 0:
        return torch.empty(H, 0, dtype=torch.int64)
    keys_t = keys.transpose(1, 2)
    q = queries.to(keys.dtype) * queries.shape[-1] ** -0.5
    best = torch.zeros(H, keys.shape[1])
    totals = []
    for at in range(0, R, ROWS_AT_ONCE):           # a few rows at a time: the scores stay in the CPU's cache
        logits = torch.bmm(q[:, at:at + ROWS_AT_ONCE], keys_t).float()
        top_logit = logits.amax(-1, keepdim=True)
        share = logits.sub_(top_logit).exp_()
        total = share.sum(-1, keepdim=True)
        best = torch.maximum(best, share.div_(total).amax(1))
        totals.append(top_logit + total.log())
    top = torch.topk(best, k, dim=1).indices                                 # [H, k], best first
    if alpha < 1:
        chosen = keys_t.gather(2, top.unsqueeze(1).expand(-1, keys_t.shape[1], -1))
        need = 0
        for at, total in zip(range(0, R, ROWS_AT_ONCE), totals):
            taken = torch.bmm(q[:, at:at + ROWS_AT_ONCE], chosen).float().sub_(total).exp_()   # shares, best first
            need = max(need, int(((taken.cumsum(-1) - taken) < alpha - 1e-6).sum(-1).max()))
        k = min(k, max(unit, -(-need // unit) * unit))
    return top[:, :k]


def choose_tokens(lh: LayerHistory, queries: torch.Tensor, alpha: float, count: int, candidates: int) -> torch.Tensor:
    """The history tokens a layer's step attends to ``[H, bs + m]``: the sink block,
    then at most ``count`` tokens its queries ``[H, R, D]`` want most
    (``select_tokens``), scored among every history token, or among the
    ``candidates x count`` the DRE's clusters rank best once the history is longer."""
    bs = lh.block_size
    narrowed = candidates * count
    if 0 < narrowed < lh.num_tokens - bs:
        scored = lh.candidates(queries, narrowed)
        keys = lh.keys.gather(1, scored.unsqueeze(-1).expand(-1, -1, lh.head_dim))
        chosen = scored.gather(1, select_tokens(queries, keys, alpha, count, bs))
    else:
        chosen = select_tokens(queries, lh.keys[:, bs:lh.num_tokens], alpha, count, bs) + bs
    return torch.cat([torch.arange(bs).expand(lh.heads, -1), chosen], 1)


@dataclasses.dataclass
class WorkingSet:
    """One (request, layer)'s pages for the kernel: ``m`` pages of history tokens
    (the sink block's among them), then room for the request's resident blocks.
    They live in the layer's buffer (``RetrievalRuntime.buffer``), in the
    request's slot, so one kernel call serves every long request of a batch.
    ``held`` names the history token at each page position, per head (-1: none)."""
    buffer: torch.Tensor                  # the slot's pages [pages, H, 2 bs, D] (a view of the layer's buffer)
    slot: int
    held: torch.Tensor                    # [H, budget pages * bs] token ids
    m: int = 0


class RetrievalRuntime:
    """Process-wide (one per worker): histories, working sets, the DRE."""

    _instance: "RetrievalRuntime | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls, cfg: KVReelConfig) -> "RetrievalRuntime":
        """The worker's runtime, made with ``cfg`` (the engine's settings) on first use."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(cfg)
            return cls._instance

    @classmethod
    def instance(cls) -> "RetrievalRuntime | None":
        return cls._instance

    def __init__(self, cfg: KVReelConfig):
        self.cfg = cfg
        self.histories: dict[str, RequestHistory] = {}
        self.rows: dict[int, str] = {}            # this step: block id of a row's newest token -> request
        self.step = 0                             # steps begun: tells one step's batch from the next
        self.working: dict[tuple[str, int], WorkingSet] = {}
        self.buffers: dict[int, torch.Tensor] = {}     # layer -> [slots * slot_pages, H, 2 bs, D]
        self.slots: dict[str, int] = {}                 # long request -> its slot in every layer's buffer
        self.caches: dict[int, torch.Tensor] = {}  # layer -> the engine's cache [blocks, H, 2 bs, D]
        self.packing: PagePacking | None = None
        self.resident_pages = 0
        self.max_batched_tokens = 0
        self.stats = KVReelStats()
        self._stats_lock = threading.Lock()
        register_stats_source(self.take_stats)
        # the DRE
        self.secret = bytes.fromhex(cfg.dre_secret_hex) if cfg.dre_secret_hex else None
        self._client: DREClient | None = None
        self._process: DREProcess | None = None
        self._dre_lock = threading.Lock()
        self._started = self._restarting = False
        self._generation = 0                          # bumped per DRE (re)connection: its tables are new
        self._tables: dict[tuple[str, int], int] = {}                 # (req, layer) -> generation holding it
        self._labels: collections.deque = collections.deque()          # (key, history, first token, reply)

    # -- set-up -----------------------------------------------------------------------
    def configure_engine(self, vllm_config) -> None:
        """Note the engine's step size (attention impls are built with its config current)."""
        self.max_batched_tokens = self.max_batched_tokens or vllm_config.scheduler_config.max_num_batched_tokens

    def register_caches(self, kv_caches: dict[str, torch.Tensor], spec, max_batched_tokens: int) -> None:
        """The engine's per-layer caches (the connector hands them over) and their geometry."""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        self.heads, self.head_dim, self.block_size = spec.num_kv_heads, spec.head_size, spec.block_size
        self.dtype = spec.dtype
        for name, cache in kv_caches.items():
            layer = layer_index(name)
            if layer is not None:
                self.caches[layer] = cache.view(cache.shape[0], self.heads, 2 * self.block_size, self.head_dim)
        self.num_layers = len(self.caches)
        isa = _get_attn_isa(self.dtype, self.block_size, self.head_dim, "auto")
        self.packing = PagePacking(self.block_size, self.head_dim, self.dtype, isa)
        self.budget_pages = max(2, self.cfg.retrieval_budget_tokens // self.block_size)
        # resident: the window, the blocks not yet confirmed in the history (one step) and the step's own
        self.resident_pages = -(-(self.cfg.retrieval_window + 2 * max_batched_tokens) // self.block_size) + 3

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
        self.step += 1

    @property
    def slot_pages(self) -> int:
        return self.budget_pages + self.resident_pages

    def buffer(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]

    def _slot(self, req_id: str) -> int:
        """The request's slot in the layers' working-set buffers (grown when all are taken)."""
        slot = self.slots.get(req_id)
        if slot is None:
            taken = set(self.slots.values())
            slot = next(i for i in range(len(taken) + 1) if i not in taken)
            self.slots[req_id] = slot
            need = (slot + 1) * self.slot_pages
            for layer in range(self.num_layers):
                old = self.buffers.get(layer)
                if old is None or old.shape[0] < need:
                    grown = torch.empty(max(need, 2 * (0 if old is None else old.shape[0])), self.heads,
                                        2 * self.block_size, self.head_dim, dtype=self.dtype)
                    if old is not None:
                        grown[:old.shape[0]] = old
                    self.buffers[layer] = grown
                    for (req, lay), ws in self.working.items():     # views of the old buffer move over
                        if lay == layer:
                            ws.buffer = self._slot_view(layer, ws.slot)
        return slot

    def _slot_view(self, layer: int, slot: int) -> torch.Tensor:
        return self.buffers[layer][slot * self.slot_pages:(slot + 1) * self.slot_pages]

    def drop(self, req_id: str) -> None:
        self.histories.pop(req_id, None)
        self.slots.pop(req_id, None)
        for layer in range(getattr(self, "num_layers", 0)):
            key = (req_id, layer)
            self.working.pop(key, None)
            if self._tables.pop(key, None) == self._generation and self._client is not None:
                self._client.submit("drop", handle=_handle(req_id, layer))

    def append_history(self, req_id: str, first_block: int, block_ids: list[int]) -> None:
        """Blocks ``first_block...`` of a request leave its window: copy their
        pages out of the engine's cache into the history (after the step that
        computed them; vLLM frees them once the scheduler has heard back)."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        self.add_history(req_id, first_block, [self.caches[layer].index_select(0, ids)
                                               for layer in range(self.num_layers)])

    @torch.inference_mode()
    def add_history(self, req_id: str, first_block: int, pages: list[torch.Tensor]) -> None:
        """Pages ``[n, H, 2 bs, D]`` per layer of blocks ``first_block...`` (from the
        engine's cache, or loaded from kvreel's tiers) join the request's history."""
        hist = self.histories.get(req_id)
        if hist is None:
            if first_block != 0:
                raise ValueError(f"history of {req_id} must start at block 0, not {first_block}")
            hist = self.histories[req_id] = RequestHistory(self.num_layers, self.heads, self.block_size,
                                                           self.head_dim, self.dtype, self.packing)
        if first_block != hist.num_blocks:
            raise ValueError(f"history of {req_id} holds {hist.num_blocks} blocks, got blocks from {first_block}")
        # unless it is all kept, the DRE's tables grow with the history: its clusters narrow long ones
        client = self.client() if self.clusters_for(hist, extra=pages[0].shape[0]) else None
        for layer, layer_pages in enumerate(pages):
            lh = hist.layers[layer]
            first_token = max(first_block, 1) * self.block_size
            keys = lh.append(layer_pages, first_block)
            if client is not None and keys.shape[1]:
                self._send_keys(client, req_id, layer, lh, keys, first_token)
        hist.num_blocks += pages[0].shape[0]

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
        now, or will before it is twice as long (so they are ready in time)."""
        blocks = 2 * (hist.num_blocks + extra)
        return (self.cfg.retrieval_candidates > 0 and not self.exact_for(hist, extra)
                and self.cfg.retrieval_candidates * self.kept_tokens(blocks) < (blocks - 1) * self.block_size)

    def kept_tokens(self, blocks: int) -> int:
        """History tokens a layer attends to beside the sink block, for a history of
        ``blocks`` blocks: the budget's share of it, at most its tokens."""
        pages = min(math.ceil(self.cfg.retrieval_budget_share * blocks), self.budget_pages)
        return (max(2, pages) - 1) * self.block_size

    # -- the DRE --------------------------------------------------------------------
    def client(self) -> DREClient | None:
        """The live DRE client; None while it is (re)starting. Never blocks on a restart."""
        with self._dre_lock:
            if self._client is not None and self._client.alive:
                return self._client
            if self._restarting:
                return None
            first, self._started = not self._started, True
            self._restarting = True
        if not first:
            self.count("dre_restarts")
            logger.warning("kvreel: the DRE service is gone; working sets stay as they are until it is back "
                           "(restarting it)")
            threading.Thread(target=self._connect, name="kvreel-dre-restart", daemon=True).start()
            return None
        self._connect()                     # the first connection is made inline
        return self._client

    def _connect(self) -> None:
        client = None
        try:
            if self.cfg.dre_address:
                client = DREClient(self.cfg.dre_address, self.secret)
            else:
                if self._process is None:
                    address = tempfile.mkdtemp(prefix="kvreel-dre-") + "/dre.sock"
                    self._process = DREProcess(address, self.secret)
                    atexit.register(self._process.stop)
                self._process.stop()
                client = self._process.start()
        except (OSError, DREError) as e:
            logger.warning("kvreel: cannot reach the DRE service (%s); working sets fall back to recent history", e)
        with self._dre_lock:
            self._client, self._restarting = client, False
            self._generation += 1

    def _send_keys(self, client: DREClient, req_id: str, layer: int, lh: LayerHistory, keys: torch.Tensor,
                   first_token: int) -> None:
        """Extend the DRE's table of this layer with new keys (clustering the whole
        history when the DRE holds none); labels come back for the layout."""
        key = (req_id, layer)
        if self._tables.get(key) == self._generation:
            fetched = self._fetched_clusters(key, lh) if self.cfg.retrieval == "mosaic" else None
            reply = client.submit("extend", handle=_handle(req_id, layer), keys=keys, fetched=fetched)
            self.count("dre_tables", label="extended")
        else:
            keys, first_token = lh.dre_keys(), self.block_size
            reply = client.submit("cluster", handle=_handle(req_id, layer), keys=keys, method=self.cfg.retrieval)
            self._tables[key] = self._generation
            self.count("dre_tables", label="clustered")
        self._labels.append((key, lh, first_token, reply))

    def _fetched_clusters(self, key: tuple[str, int], lh: LayerHistory) -> torch.Tensor | None:
        """Per head, the clusters of the history tokens the layer's working set
        holds now ``[H, F]`` (-1 padding): Mosaic applies their pending splits."""
        ws = self.working.get(key)
        if ws is None or not ws.m:
            return None
        per_head = []
        for h in range(self.heads):
            tokens = ws.held[h, :ws.m * self.block_size]
            tokens = tokens[(tokens >= self.block_size) & (tokens < lh.num_tokens)] - self.block_size
            labels = torch.unique(lh.labels[h, tokens])
            per_head.append(labels[labels >= 0])
        out = torch.full((self.heads, max(len(x) for x in per_head)), -1, dtype=torch.int64)
        for h, labels in enumerate(per_head):
            out[h, :len(labels)] = labels
        return out

    @torch.inference_mode()
    def _take_labels(self) -> None:
        """Apply the DRE's labels that have arrived, in the order they were asked
        for, on the thread that runs attention (the only one that touches the
        histories: the DRE client's reader thread only completes futures)."""
        while self._labels and self._labels[0][3].done():
            key, lh, first, fut = self._labels.popleft()
            try:
                reply = fut.result()
            except DREError:
                self._tables.pop(key, None)         # cluster anew next time
                continue
            if self.histories.get(key[0]) is None or self.histories[key[0]].layers[key[1]] is not lh:
                continue                            # the request is gone
            labels = reply["labels"]
            if "relabelled" in reply:               # Mosaic split clusters: every token's label is new
                labels, first = reply["relabelled"], self.block_size
            lh.set_labels(first, labels)

    # -- attention ----------------------------------------------------------------------
    def working_set(self, req_id: str, layer: int, queries: torch.Tensor) -> WorkingSet:
        """The working set of this (request, layer) for this step: the sink block
        and the history tokens this step's own queries ``[H, R, D]`` want most
        (``select_tokens``), written into its pages where they are not already."""
        self._take_labels()
        hist = self.histories[req_id]
        lh = hist.layers[layer]
        ws = self.working.get((req_id, layer))
        if ws is None:
            slot = self._slot(req_id)
            ws = self.working[(req_id, layer)] = WorkingSet(
                self._slot_view(layer, slot), slot,
                torch.full((self.heads, self.budget_pages * self.block_size), -1, dtype=torch.int64))
        if self.exact_for(hist):
            self._fill_in_order(ws, lh)
            self.count("retrieval_steps", label="exact")
            return ws
        client = self.client() if self.clusters_for(hist) else None
        if client is not None and self._tables.get((req_id, layer)) != self._generation:
            self._send_keys(client, req_id, layer, lh, lh.dre_keys(), self.block_size)   # a new DRE: cluster anew
        self._fill(ws, lh, choose_tokens(lh, queries, self.cfg.retrieval_alpha, self.kept_tokens(hist.num_blocks),
                                         self.cfg.retrieval_candidates))
        down = client is None and self.clusters_for(hist)
        self.count("retrieval_steps", label="dre_down" if down else "selected")
        self.count("retrieval_history_blocks", hist.num_blocks)
        self.count("retrieval_kept_blocks", ws.m)
        return ws

    def _fill_in_order(self, ws: WorkingSet, lh: LayerHistory) -> None:
        """Every history token, token t at page position t (as vLLM's own cache
        holds them, so the kernel sums in the same order); only positions that
        hold another token are written."""
        n = lh.num_tokens
        want = torch.arange(n)
        heads, slots = torch.nonzero(ws.held[:, :n] != want, as_tuple=True)
        self._write(ws, lh, heads, slots, slots)
        ws.held[:, :n] = want
        ws.held[:, n:] = -1
        ws.m = n // self.block_size

    def _fill(self, ws: WorkingSet, lh: LayerHistory, want: torch.Tensor) -> None:
        """The tokens ``want`` ``[H, N]`` (N a whole number of pages) in the first
        pages, in any order: a token that stays keeps its place (a step's choice
        mostly repeats the last one), the others are written where they go."""
        n = want.shape[1]
        heads, slots, tokens = [], [], []
        for h in range(self.heads):
            held = ws.held[h, :n]
            stays = torch.isin(held, want[h])
            free = torch.nonzero(~stays).flatten()
            heads.append(torch.full_like(free, h))
            slots.append(free)
            tokens.append(want[h][~torch.isin(want[h], held[stays])])
        heads, slots, tokens = torch.cat(heads), torch.cat(slots), torch.cat(tokens)
        self._write(ws, lh, heads, slots, tokens)
        ws.held[heads, slots] = tokens
        ws.held[:, n:] = -1
        ws.m = n // self.block_size

    def _write(self, ws: WorkingSet, lh: LayerHistory, heads: torch.Tensor, slots: torch.Tensor,
               tokens: torch.Tensor) -> None:
        if heads.numel():
            self.packing.write_tokens(ws.buffer, slots // self.block_size, heads, slots % self.block_size,
                                      lh.keys[heads, tokens], lh.values[heads, tokens])


def _handle(req_id: str, layer: int) -> str:
    return f"{req_id}/{layer}"


def layer_index(name: str) -> int | None:
    """The layer number in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None
