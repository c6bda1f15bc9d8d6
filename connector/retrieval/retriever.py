"""The process-wide side of retrieval attention: settings, the DRE connection
(started or reached on first use, restarted in the background when it dies),
the per-layer selections with their deadline, and the counters the connector
exports. Kept apart from the attention backend so the connector can read the
counters without importing vLLM's CPU attention module."""

from __future__ import annotations

import atexit
import logging
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Callable

import torch

from kvreel.connector.config import KVReelConfig
from kvreel.connector.retrieval.dre_service import DREClient, DREError, DREProcess
from kvreel.connector.stats import KVReelStats, register_stats_source

if TYPE_CHECKING:
    from kvreel.connector.retrieval.attention_backend import RetrievalAttentionImpl

logger = logging.getLogger(__name__)
MAX_TABLES = 4096            # DRE tables kept per process (older ones are dropped)


class Retriever:
    """Process-wide: the settings, the DRE connection, the layers' impls, counters."""

    _instance: "Retriever | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> "Retriever":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(KVReelConfig.load())
            return cls._instance

    def __init__(self, cfg: KVReelConfig):
        self.cfg = cfg
        self.active = cfg.retrieval != "off" and cfg.retrieval_alpha < 1
        self.secret = bytes.fromhex(cfg.dre_secret_hex) if cfg.dre_secret_hex else None
        self.layers: dict[int, "RetrievalAttentionImpl"] = {}
        self.stats = KVReelStats()
        self._lock = threading.Lock()
        self._client: DREClient | None = None
        self._process: DREProcess | None = None
        self._started = self._restarting = False
        # (layer, request's first block) -> (handle of the table the DRE holds for it, its history blocks)
        self._tables: OrderedDict[tuple[int, int], tuple[str, int]] = OrderedDict()
        self._prefetched: dict[tuple[int, int, str], Future] = {}     # (layer, owner, history) -> select
        register_stats_source(self.take_stats)

    # -- the DRE connection --------------------------------------------------------
    def client(self) -> DREClient | None:
        """The live DRE client; None while it is (re)starting. Never blocks on a restart."""
        with self._lock:
            if self._client is not None and self._client.alive:
                return self._client
            if self._restarting:
                return None
            first, self._started = not self._started, True
            self._restarting = True
        if not first:
            self.count("dre_restarts")
            logger.warning("kvreel: the DRE service is gone; full attention until it is back (restarting it)")
        if first:
            self._connect()                 # the first connection is made inline (worker start-up)
            return self._client
        threading.Thread(target=self._connect, name="kvreel-dre-restart", daemon=True).start()
        return None

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
            logger.warning("kvreel: cannot reach the DRE service (%s); full attention for now", e)
        with self._lock:
            self._client, self._restarting = client, False
            self._tables.clear()
            self._prefetched.clear()

    def count(self, name: str, value: float = 1, label: str | None = None) -> None:
        with self._lock:
            self.stats.add(name, value, label)

    def take_stats(self) -> KVReelStats | None:
        with self._lock:
            return self.stats.take()

    # -- selection -------------------------------------------------------------------
    def _request(self, client: DREClient, layer: int, owner: int, name_of: Callable[[int], str], n_blocks: int,
                 keys_of: Callable[[int, int], torch.Tensor], queries: torch.Tensor, block: int) -> Future:
        """Bring the DRE's table of the layer's history up to date and select.
        A history that grew by blocks at its end (a session going on) is
        extended with the new blocks' keys; any other is clustered anew."""
        handle = f"{layer}:{name_of(n_blocks)}"
        held = self._tables.get((layer, owner))
        if held is None or held[0] != handle:
            if held is not None and held[1] < n_blocks and held[0] == f"{layer}:{name_of(held[1])}":
                client.submit("extend", handle=handle, base=held[0], keys=keys_of(layer, held[1]).float())
                self._tables.pop((layer, owner))
                self.count("dre_tables", label="extended")
            else:
                if held is not None:
                    client.submit("drop", handle=self._tables.pop((layer, owner))[0])
                while len(self._tables) >= MAX_TABLES:      # finished requests' tables
                    client.submit("drop", handle=self._tables.popitem(last=False)[1][0])
                client.submit("cluster", handle=handle, keys=keys_of(layer, 0).float(), method=self.cfg.retrieval)
                self.count("dre_tables", label="clustered")
            self._tables[(layer, owner)] = (handle, n_blocks)
        return client.submit("select", handle=handle, queries=queries.float(), alpha=self.cfg.retrieval_alpha,
                             per_frame=True, block=block)

    def selection(self, layer: int, owner: int, name_of: Callable[[int], str], n_blocks: int,
                  queries: torch.Tensor, keys_of: Callable[[int, int], torch.Tensor],
                  block: int) -> torch.Tensor | None:
        """Token ids (into the history) to attend to at ``layer``, or None: use full attention.
        ``owner`` names the request (its first block); ``name_of(n)`` names its first
        n history blocks; ``keys_of(layer, first)`` are the layer's keys [heads, T, D]
        of the history from block ``first`` on."""
        client = self.client()
        if client is None:
            self.count("retrieval_steps", label="dre_down")
            return None
        history_key = name_of(n_blocks)
        try:
            fut = self._prefetched.pop((layer, owner, history_key), None) or \
                self._request(client, layer, owner, name_of, n_blocks, keys_of, queries, block)
            nxt = self.layers.get(layer + 1)
            if nxt is not None and nxt.key_mirror is not None:
                # the next layer's selection, predicted from this layer's queries (cross-layer prefetch)
                if len(self._prefetched) > MAX_TABLES:      # left by requests that ended mid-step
                    self._prefetched.clear()
                self._prefetched[(layer + 1, owner, history_key)] = self._request(
                    client, layer + 1, owner, name_of, n_blocks, keys_of, queries, block)
            reply = fut.result(timeout=self.cfg.retrieval_deadline_ms / 1000)
        except FutureTimeout:
            self.count("retrieval_steps", label="dre_late")
            return None
        except DREError as e:
            self.count("retrieval_steps", label="dre_down")
            logger.warning("kvreel: DRE selection failed (%s); full attention for this step", e)
            with self._lock:
                self._tables.pop((layer, owner), None)        # cluster it anew next step
            return None
        self.count("retrieval_steps", label="selected")
        return reply["tokens"]
