"""Retrieval attention in a worker process: the long sessions' histories, their
working sets, the DRE, and what each layer attends to.

A request is *long* once kvreel holds part of its history (blocks that left its
local window; ``kvreel.connector.retrieval.offload`` frees them in vLLM). For
a long request every layer attends, with vLLM's own CPU kernel, to a
*working set*: the sink block and the history slabs selected for this layer,
followed by the request's blocks still in vLLM's cache (window and the step's
own tokens), copied behind them. Keys are post-RoPE, so where a token sits in
the working set changes nothing but summation order; every history token
precedes every query, so causal masking is unchanged.

What each layer keeps:

* exact (``KVREEL_RETRIEVAL_ALPHA=1`` and a budget that holds the history):
  every history slab in token order, so attention is bit-identical to vLLM's
  over its own cache;
* otherwise the DRE predicts each history token's attention mass from the
  clusters of the layer's keys; per KV head, slabs are kept in descending mass
  until ``alpha`` of it (WiCSum) or the budget. A layer's prediction comes from
  its own queries: a prefill chunk's from its own, waited for at most
  ``KVREEL_RETRIEVAL_DEADLINE_MS``; a decode step's from the step its history
  last grew a block, never waited for (see ``working_set``). Without one in
  time a layer keeps its previous working set (or, for a first one, the most
  recent history), counted as late or down.

Slabs that joined the history after the last prediction are always kept."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import re
import tempfile
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from kvreel.connector.config import KVReelConfig
from kvreel.connector.retrieval.dre_service import DREClient, DREError, DREProcess
from kvreel.connector.retrieval.history import LayerHistory, RequestHistory
from kvreel.connector.retrieval.page_packing import PagePacking
from kvreel.connector.stats import KVReelStats, register_stats_source

logger = logging.getLogger(__name__)
COMPACT_AT = 0.25            # rebuild a head's slabs in cluster order once this share is unsorted


def select_slabs(slab_mass: torch.Tensor, alpha: float, budget: int, unscored: int = 0) -> torch.Tensor:
    """Per KV head, slab indices to keep ``[H, m]``: the ``unscored`` newest slabs
    (added after the prediction), then slabs in descending predicted mass until
    ``alpha`` of the head's mass (WiCSum), all heads padded to one count ``m``
    (the next-best slabs) and capped at ``budget``."""
    H, n = slab_mass.shape
    if n == 0 or budget <= 0:
        return torch.empty(H, 0, dtype=torch.int64)
    mass = slab_mass.float().clone()
    if unscored:
        mass[:, n - unscored:] = float("inf")
    order = torch.argsort(mass, dim=1, descending=True, stable=True)
    finite = torch.nan_to_num(mass.gather(1, order), posinf=0.0)
    total = finite.sum(1, keepdim=True).clamp_min(1e-30)
    before = finite.cumsum(1) - finite
    need = int(((before < alpha * total - 1e-9) | ~torch.isfinite(mass.gather(1, order))).sum(1).max())
    return order[:, :max(1, min(budget, need, n))]


@dataclasses.dataclass
class WorkingSet:
    """One (request, layer)'s pages for the kernel: ``m`` selected pages (sink
    first), then room for the request's resident blocks. They live in the
    layer's buffer (``RetrievalRuntime.buffer``), in the request's slot, so one
    kernel call serves every long request of a batch."""
    buffer: torch.Tensor                  # the slot's pages [pages, H, 2 bs, D] (a view of the layer's buffer)
    slot: int
    slabs: torch.Tensor | None = None     # [H, m - 1] history slab indices loaded (None: nothing yet)
    version: int = -1                     # LayerHistory.version the slab indices refer to
    prediction: int = -1                  # id of the prediction they came from
    known: int = 0                        # history slabs there were when it was chosen

    @property
    def m(self) -> int:
        return 0 if self.slabs is None else 1 + self.slabs.shape[1]


class RetrievalRuntime:
    """Process-wide (one per worker): histories, working sets, the DRE."""

    _instance: "RetrievalRuntime | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "RetrievalRuntime":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(KVReelConfig.load())
            return cls._instance

    def __init__(self, cfg: KVReelConfig):
        self.cfg = cfg
        self.exact = cfg.retrieval_alpha >= 1
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
        self.offloading = False
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
        self._asked: dict[tuple[str, int], tuple[int, Future, int]] = {}   # in flight: (id, reply, tokens)
        self._predicted: dict[tuple[str, int], tuple[int, torch.Tensor]] = {}  # latest (id, mass [H, T])
        self._next_prediction = 0

    # -- set-up -----------------------------------------------------------------------
    def configure_engine(self, vllm_config) -> None:
        """Note the engine's settings (attention impls are built with them current):
        history is offloaded only with kvreel's connector attached."""
        if self.max_batched_tokens:
            return
        self.max_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        kv = vllm_config.kv_transfer_config
        self.offloading = kv is not None and kv.kv_connector == "KVReelConnector"
        if not self.offloading:
            logger.error("kvreel: KVREEL_RETRIEVAL needs kvreel's connector (--kv-transfer-config "
                         "'{\"kv_connector\":\"KVReelConnector\",\"kv_connector_module_path\":\"kvreel.connector\","
                         "\"kv_role\":\"kv_both\"}'); attention stays full")

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
            self._asked.pop(key, None)
            self._predicted.pop(key, None)
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
        # with alpha < 1 the DRE's tables grow with the history, ready when it outgrows the budget
        client = None if self.exact and self.exact_for(hist, extra=pages[0].shape[0]) else self.client()
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
        """Whether every history page (plus ``extra`` more) fits the budget: then
        all are attended to, in token order, with no prediction needed."""
        return (hist.num_blocks + extra) <= self.budget_pages

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
            self._asked.clear()

    def _send_keys(self, client: DREClient, req_id: str, layer: int, lh: LayerHistory, keys: torch.Tensor,
                   first_token: int) -> None:
        """Extend the DRE's table of this layer with new keys (clustering the whole
        history when the DRE holds none); labels come back for the layout."""
        key = (req_id, layer)
        if self._tables.get(key) == self._generation:
            reply = client.submit("extend", handle=_handle(req_id, layer), keys=keys)
            self.count("dre_tables", label="extended")
        else:
            keys, first_token = lh.keys(), self.block_size
            reply = client.submit("cluster", handle=_handle(req_id, layer), keys=keys, method=self.cfg.retrieval)
            self._tables[key] = self._generation
            self.count("dre_tables", label="clustered")
        reply.add_done_callback(lambda fut: self._labelled(key, lh, first_token, fut))

    def _labelled(self, key, lh: LayerHistory, first_token: int, fut: Future) -> None:
        try:
            labels = fut.result()["labels"]
        except DREError:
            self._tables.pop(key, None)         # cluster anew next time
            return
        if lh.num_tokens >= first_token - self.block_size + labels.shape[1]:
            with torch.inference_mode():        # the history's tensors may be inference tensors
                lh.set_labels(first_token, labels)

    def _ask(self, client: DREClient, req_id: str, layer: int, queries: torch.Tensor, tokens: int) -> None:
        key = (req_id, layer)
        if key in self._asked or self._tables.get(key) != self._generation:
            return
        if key in self._predicted and self._predicted[key][2] >= tokens:
            return          # decode: one prediction per new history block, not per token
        self._next_prediction += 1
        self._asked[key] = (self._next_prediction, client.submit(
            "mass", handle=_handle(req_id, layer), queries=queries.float(), alpha=self.cfg.retrieval_alpha), tokens)

    def _prediction(self, req_id: str, layer: int, lh: LayerHistory,
                    wait: bool) -> tuple[int, torch.Tensor, int] | str:
        """The newest predicted mass of this layer (id, [H, T], tokens it covers), after
        waiting up to the deadline for one in flight; "late"/"down" when none came."""
        key = (req_id, layer)
        asked = self._asked.get(key)
        if asked is not None:
            pid, fut, tokens = asked
            try:
                reply = fut.result(timeout=self.cfg.retrieval_deadline_ms / 1000 if wait else 0)
                self._predicted[key] = (pid, reply["mass"], tokens)
                if "labels" in reply:                        # Mosaic split clusters
                    lh.set_labels(self.block_size, reply["labels"][:, :lh.num_tokens])
            except FutureTimeout:
                return self._predicted.get(key) or "late"
            except DREError as e:
                logger.warning("kvreel: DRE prediction failed (%s)", e)
                self._tables.pop(key, None)
            del self._asked[key]
        return self._predicted.get(key) or ("late" if asked else "down")

    # -- attention ----------------------------------------------------------------------
    def working_set(self, req_id: str, layer: int, queries: torch.Tensor, decoding: bool = False) -> WorkingSet:
        """The working set of this (request, layer) for this step, refreshed from
        the newest prediction of the layer's attention mass, made from the
        layer's own queries (another layer's queries live in another projection
        space and predict far worse: bench/retrieval_served.py). A prefill chunk
        asks with its own queries and waits up to the deadline (its step is
        long). A decode step never waits once a prediction has arrived: it takes
        the newest, made from this layer's queries at the step the history last
        grew a block, and asks anew when it grows again; the DRE works during
        the steps that follow, so per-token latency does not carry its cost."""
        hist = self.histories[req_id]
        lh = hist.layers[layer]
        ws = self.working.get((req_id, layer))
        if ws is None:
            slot = self._slot(req_id)
            ws = self.working[(req_id, layer)] = WorkingSet(self._slot_view(layer, slot), slot)
        if self.exact_for(hist):
            self._fill(ws, lh, torch.arange(lh.n_slabs).expand(self.heads, -1), prediction=-1)
            self.count("retrieval_steps", label="exact")
            return ws
        client = self.client()
        first = (req_id, layer) not in self._predicted
        if client is not None:
            if self._tables.get((req_id, layer)) != self._generation:
                self._send_keys(client, req_id, layer, lh, lh.keys(), self.block_size)
            if not decoding or first:
                self._ask(client, req_id, layer, queries, lh.num_tokens)
        got = self._prediction(req_id, layer, lh, wait=client is not None and (not decoding or first))
        if client is not None and decoding:
            self._ask(client, req_id, layer, queries, lh.num_tokens)         # for the steps to come
        if isinstance(got, tuple):
            pid, mass, tokens = got
            if pid != ws.prediction or ws.version != lh.version or lh.n_slabs != ws.known:
                unscored = lh.n_slabs - tokens // self.block_size
                padded = torch.zeros(self.heads, lh.num_tokens)
                padded[:, :mass.shape[1]] = mass[:, :lh.num_tokens]
                slabs = select_slabs(lh.slab_mass(padded), self.cfg.retrieval_alpha, self.budget_pages - 1,
                                     unscored)
                self._fill(ws, lh, slabs, pid)
            self.count("retrieval_steps", label="selected")
        else:
            if ws.slabs is None or ws.version != lh.version or lh.n_slabs != ws.known:
                newest = torch.arange(max(0, lh.n_slabs - self.budget_pages + 1), lh.n_slabs)
                self._fill(ws, lh, newest.expand(self.heads, -1), prediction=-1)
            self.count("retrieval_steps", label="dre_" + got)
        self.count("retrieval_history_blocks", hist.num_blocks)
        self.count("retrieval_kept_blocks", ws.m)
        return ws

    def _fill(self, ws: WorkingSet, lh: LayerHistory, slabs: torch.Tensor, prediction: int) -> None:
        """Bring the chosen slabs of every head behind the sink page, copying only
        those not already there (a slab that stays keeps its place: the order of
        history pages does not matter to attention, and a step's new choice
        mostly repeats the last one)."""
        slabs = slabs.contiguous()
        m = slabs.shape[1]
        if lh.sink is not None and ws.slabs is None:
            ws.buffer[0] = lh.sink
        if ws.slabs is None or ws.version != lh.version:
            for h in range(self.heads):
                ws.buffer[1:1 + m, h] = lh.slabs[h].index_select(0, slabs[h])
        else:
            placed = torch.full_like(slabs, -1)
            for h in range(self.heads):
                have = ws.slabs[h, :m]
                stays = torch.isin(have, slabs[h])
                placed[h, :len(have)] = torch.where(stays, have, -1)
                free = torch.nonzero(placed[h] < 0).flatten()
                if free.numel():
                    incoming = slabs[h][~torch.isin(slabs[h], have[stays])]
                    placed[h, free] = incoming
                    ws.buffer[1 + free, h] = lh.slabs[h].index_select(0, incoming)
            slabs = placed
        ws.slabs, ws.version, ws.prediction, ws.known = slabs, lh.version, prediction, lh.n_slabs

    def compact(self, req_id: str) -> None:
        """Rebuild, in cluster order, the layers whose unsorted share grew past COMPACT_AT."""
        hist = self.histories.get(req_id)
        if hist is None or self.exact_for(hist):
            return
        for lh in hist.layers:
            labelled = bool((lh.labels >= 0).all()) if lh.labels.numel() else False
            if labelled and lh.unsorted_share() > COMPACT_AT:
                lh.compact()


def _handle(req_id: str, layer: int) -> str:
    return f"{req_id}/{layer}"


def layer_index(name: str) -> int | None:
    """The layer number in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None
