"""A worker's link to the DRE: its connection (started, or restarted after it
died, without ever blocking attention on a restart), the tables it holds for
each (request, layer), and the labels it sends back.

Threads: everything here runs on the thread that runs the model, except the
DRE client's reader thread, which only completes reply futures, and a restart
thread, which only swaps in the new client under ``_lock``. Labels are applied
to the histories by ``take_labels``, on the model's thread, in the order they
were asked for."""

from __future__ import annotations

import atexit
import collections
import logging
import tempfile
import threading
from typing import Callable

import torch

from kvreel.connector.config import KVReelConfig
from kvreel.dre.client import DREClient, DREProcess
from kvreel.dre.wire import DREError, is_private
from kvreel.connector.retrieval.history import LayerHistory, RequestHistory
from kvreel.connector.retrieval.working_set import WorkingSet

logger = logging.getLogger(__name__)


class DRELink:
    def __init__(self, cfg: KVReelConfig, count: Callable[..., None]):
        self.cfg = cfg
        self.count = count
        self.secret = bytes.fromhex(cfg.dre_secret_hex) if cfg.dre_secret_hex else None
        self._client: DREClient | None = None
        self._process: DREProcess | None = None
        self._lock = threading.Lock()
        self._started = self._restarting = False
        self._generation = 0                          # bumped per DRE (re)connection: its tables are new
        self._tables: dict[tuple[str, int], int] = {}                  # (req, layer) -> generation holding it
        self._table_bytes: dict[tuple[str, int], int] = {}             # (req, layer) -> bytes the DRE said
        # a DRE on this host (the worker's child, a Unix socket, loopback) takes host memory beside the histories
        self.on_this_host = not cfg.dre_address or is_private(cfg.dre_address)
        self._labels: collections.deque = collections.deque()           # (key, history, first token, reply)

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
            logger.warning("kvreel: the DRE service is gone; restarting it (meanwhile, tokens it has not "
                           "clustered are all scored)")
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
            logger.warning("kvreel: cannot reach the DRE service (%s); tokens it has not clustered are all "
                           "scored", e)
        with self._lock:
            self._client, self._restarting = client, False
            self._generation += 1

    def holds(self, req_id: str, layer: int) -> bool:
        return self._tables.get((req_id, layer)) == self._generation

    def table_bytes(self) -> int:
        """Host memory the DRE's live tables take, as its last replies said; 0 for a
        DRE on another host."""
        if not self.on_this_host:
            return 0
        return sum(n for key, n in list(self._table_bytes.items()) if self.holds(*key))

    def send(self, client: DREClient, req_id: str, layer: int, lh: LayerHistory, keys: torch.Tensor,
             first_token: int, ws: WorkingSet | None) -> None:
        """Extend the DRE's table of this layer with new keys (clustering the whole
        history when the DRE holds none); the labels come back to ``take_labels``."""
        key = (req_id, layer)
        if self.holds(req_id, layer):
            fetched = read_clusters(ws, lh) if self.cfg.retrieval == "mosaic" and ws is not None else None
            reply = client.submit("extend", handle=_handle(req_id, layer), keys=keys, fetched=fetched)
            self.count("dre_tables", label="extended")
        else:
            keys, first_token = lh.dre_keys(), lh.block_size
            reply = client.submit("cluster", handle=_handle(req_id, layer), keys=keys, method=self.cfg.retrieval)
            self._tables[key] = self._generation
            self.count("dre_tables", label="clustered")
        self._labels.append((key, lh, first_token, reply))

    @torch.inference_mode()
    def take_labels(self, histories: dict[str, RequestHistory]) -> None:
        """Apply the labels that have arrived, in the order they were asked for."""
        while self._labels and self._labels[0][3].done():
            key, lh, first, fut = self._labels.popleft()
            try:
                reply = fut.result()
            except DREError:
                self._tables.pop(key, None)         # cluster anew next time
                self._table_bytes.pop(key, None)
                continue
            hist = histories.get(key[0])
            if hist is None or hist.layers[key[1]] is not lh:
                continue                            # the request is gone
            self._table_bytes[key] = int(reply.get("table_bytes", 0))
            labels = reply["labels"]
            if "relabelled" in reply:               # Mosaic split clusters: every token's label is new
                labels, first = reply["relabelled"], lh.block_size
            lh.set_labels(first, labels)

    def drop(self, req_id: str, layer: int) -> None:
        self._table_bytes.pop((req_id, layer), None)
        if self._tables.pop((req_id, layer), None) == self._generation and self._client is not None:
            self._client.submit("drop", handle=_handle(req_id, layer))


def read_clusters(ws: WorkingSet, lh: LayerHistory) -> torch.Tensor | None:
    """Per head, the clusters of the history tokens a working set holds ``[H, F]``
    (-1 padding): Mosaic applies their pending splits (its deferred split)."""
    if not ws.m:
        return None
    bs = lh.block_size
    per_head = []
    for h in range(lh.heads):
        tokens = ws.held[h, :ws.m * bs]
        tokens = tokens[(tokens >= bs) & (tokens < lh.num_tokens)] - bs
        labels = torch.unique(lh.labels[h, tokens])
        per_head.append(labels[labels >= 0])
    out = torch.full((lh.heads, max(len(x) for x in per_head)), -1, dtype=torch.int64)
    for h, labels in enumerate(per_head):
        out[h, :len(labels)] = labels
    return out


def _handle(req_id: str, layer: int) -> str:
    return f"{req_id}/{layer}"
