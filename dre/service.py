"""The DRE: the expensive part of retrieval (ReSV's hash-bit clustering, Mosaic's
nested k-means, online assignment and splits) as an asynchronous co-processor
service in its own process. It never sits on a step's critical path: it labels
each history token with its cluster, and the worker rebuilds the history's
slabs in cluster order with those labels; every step's selection is made in
the worker from the step's own queries (``kvreel.connector.retrieval.runtime``).

The wire (``wire``): length-prefixed JSON frames with their tensors in
shared memory or inline, never pickled, a shared-secret handshake; the
client and the child process a worker starts are in ``client``.

Requests (each answered once, in any order, matched by ``id``), one table per
``handle`` (a request's layer, all its KV heads):

* ``cluster``  keys ``[heads, T, D]`` of a history and ``method`` resv (HC table)
  or mosaic (centroid index) -> the table; reply: each token's cluster
  ``labels`` ``[heads, T]``, and ``table_bytes``, what the handle's tables take
  (as every ``extend``'s reply: the worker charges it to ``KVREEL_CPU_BYTES``).
* ``extend``   the keys of the tokens that follow the table's history -> the
  grown table (ReSV hashes only the new tokens, Mosaic assigns them online);
  reply: their ``labels`` ``[heads, n]``. With Mosaic, ``fetched``
  ``[heads, F]`` (cluster ids, -1 padding) names the clusters the worker has
  been reading: their pending splits are applied now (their keys were needed
  anyway, Mosaic's deferred split), and the reply's ``relabelled``
  ``[heads, T]`` gives every token's new label.
* ``drop``     forget a handle;  ``ping``  liveness.

Requests that arrive together are served as one batch (the service drains its
socket before computing). ``DREClient.submit`` returns a future; a dead service
fails it, and ``DREProcess`` restarts the service.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import secrets
import selectors
import socket
import sys

import torch

from kvreel.dre.mosaic import MosaicSession
from kvreel.dre.resv import HASH_BITS, Clusters, cluster_keys, extend_clusters, hyperplanes
from kvreel.dre.wire import (MAX_TENSOR_BYTES, DREError, decode_tensors, discard_orphaned_segments, encode_tensors,
                             ipc_namespace, is_private, listen, parse_secret_hex, proof, recv_msg, send_msg)

logger = logging.getLogger(__name__)


class DREService:
    """Holds HC tables per handle and answers requests in batches."""

    def __init__(self, bits: int = HASH_BITS, hamming: int = 0, secret: bytes | None = None):
        self.bits, self.hamming, self.secret = bits, hamming, secret
        self.tables: dict[str, object] = {}
        self._planes: dict[int, torch.Tensor] = {}

    def handle(self, msg: dict) -> dict:
        """One request, its tensors already received; the reply, with tensors."""
        op = msg.get("op")
        if op == "ping":
            return {"ok": True}
        if op == "drop":
            self.tables.pop(str(msg.get("handle")), None)
            return {"ok": True}
        if op in ("cluster", "extend"):
            keys = _head_keys(msg)
            handle = str(msg.get("handle"))
            split = False
            if op == "cluster":
                method = str(msg.get("method", "resv"))
                if method not in ("resv", "mosaic"):
                    raise DREError(f"cluster wants method resv|mosaic, got {method[:20]!r}")
                segment = max(1, int(msg.get("segment", 32)))
                tables = [cluster_keys(k, self._planes_for(k), self.hamming) if method == "resv"
                          else MosaicSession.build(k, segment) for k in keys]
                first = 0
                labels = [_owners(t, keys.shape[1]) for t in tables]
            else:
                tables, first = self._table(handle)
                if keys.shape[0] != len(tables):
                    raise DREError(f"extend wants keys of {len(tables)} heads, got {tuple(keys.shape)}")
                fetched = _fetched(msg, len(tables))
                labels = []
                for i, (k, table) in enumerate(zip(keys, tables)):
                    if isinstance(table, Clusters):
                        tables[i] = extend_clusters(table, k, self._planes_for(k), self.hamming)
                        labels.append(tables[i].labels[first:])
                    else:
                        labels.append(table.extend(k))
                        if fetched is not None:
                            split |= table.after_fetch(fetched[i][(fetched[i] >= 0)
                                                                  & (fetched[i] < len(table.index.clusters))])
            n_tokens = first + keys.shape[1]
            self.tables[handle] = (tables, n_tokens)
            reply = {"ok": True, "clusters": sum(_num_clusters(t) for t in tables),
                     "table_bytes": sum(t.nbytes for t in tables),
                     "labels": torch.stack(labels)}
            if split:
                reply["relabelled"] = torch.stack([_owners(t, n_tokens) for t in tables])
            return reply
        raise DREError(f"unknown op {str(op)[:40]!r}")

    def _table(self, handle: str) -> tuple[list, int]:
        entry = self.tables.get(handle)
        if entry is None:
            raise DREError(f"unknown handle {handle[:80]!r}")
        return entry

    def _planes_for(self, keys: torch.Tensor) -> torch.Tensor:
        return self._planes.setdefault(keys.shape[1], hyperplanes(keys.shape[1], self.bits, seed=1))

    def serve(self, address: str, parent_pid: int | None = None) -> None:
        """Serve until killed (or, with ``parent_pid``, until that process is gone:
        a DRE started by a vLLM worker never outlives it). ``address``: a
        filesystem path (Unix socket) or host:port."""
        if self.secret is None and not is_private(address):
            raise DREError(f"refusing to serve {address} without a shared secret: anyone who reaches it could "
                           "use the service; set KVREEL_DRE_SECRET_HEX, or listen on loopback or a Unix socket")
        listener = listen(address)
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        authed: dict[socket.socket, str | None] = {}
        print(f"kvreel DRE listening on {address}", flush=True)
        while True:
            batch = []
            def drop(conn):
                sel.unregister(conn)
                authed.pop(conn, None)
                conn.close()
            ready = sel.select(timeout=1.0)
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("kvreel DRE: parent process %d is gone; exiting", parent_pid)
                discard_orphaned_segments(also=os.getpid())      # its requests and our replies, unread
                return
            for key, _ in ready:
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    nonce = secrets.token_hex(16) if self.secret else None
                    authed[conn] = nonce
                    sel.register(conn, selectors.EVENT_READ)
                    try:
                        send_msg(conn, {"hello": "kvreel-dre", "nonce": nonce, "ipc": ipc_namespace()})
                    except OSError:
                        drop(conn)
                    continue
                conn = key.fileobj
                nonce = authed.get(conn)
                try:               # nothing but a JSON proof before the secret is proven
                    msg, blob = recv_msg(conn, max_blob=0 if nonce is not None else MAX_TENSOR_BYTES)
                except (OSError, DREError, ValueError):       # closed, oversized or not JSON
                    drop(conn)
                    continue
                if nonce is not None:          # the first message must prove the secret
                    ok = msg.get("op") == "auth" and hmac.compare_digest(str(msg.get("proof", "")),
                                                                         proof(self.secret, nonce))
                    try:
                        send_msg(conn, {"id": msg.get("id"), "ok": ok} if ok else
                                 {"id": msg.get("id"), "ok": False, "error": "authentication failed"})
                    except OSError:
                        ok = False
                    if ok:
                        authed[conn] = None
                    else:
                        drop(conn)
                    continue
                batch.append((conn, msg, blob))
            for conn, msg, blob in batch:      # everything that arrived together, served together
                try:
                    reply, out = encode_tensors(self.handle(decode_tensors(msg, blob)), bool(msg.get("inline")))
                except (DREError, KeyError, ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
                    reply, out = {"ok": False, "error": str(e)[:500]}, b""
                reply["id"] = msg.get("id")
                try:
                    send_msg(conn, reply, out)
                except OSError:
                    pass


def _tensor(msg: dict, name: str) -> torch.Tensor:
    value = msg.get(name)
    if not isinstance(value, torch.Tensor):
        raise DREError(f"{name} must be a tensor")
    return value


def _head_keys(msg: dict) -> torch.Tensor:
    keys = _tensor(msg, "keys").float()
    keys = keys.unsqueeze(0) if keys.dim() == 2 else keys
    if keys.dim() != 3:
        raise DREError(f"{msg.get('op')} wants keys [T, D] or [heads, T, D], got {tuple(keys.shape)}")
    return keys


def _fetched(msg: dict, heads: int) -> torch.Tensor | None:
    if msg.get("fetched") is None:
        return None
    fetched = _tensor(msg, "fetched").long()
    if fetched.dim() != 2 or fetched.shape[0] != heads:
        raise DREError(f"fetched wants cluster ids [{heads} heads, F], got {tuple(fetched.shape)}")
    return fetched


def _owners(table, n_tokens: int) -> torch.Tensor:
    """[n_tokens]: each token's cluster (-1: in none; an HC table's labels cover every token)."""
    return table.labels if isinstance(table, Clusters) else table.index.owners(n_tokens)


def _num_clusters(table) -> int:
    return table.num_clusters if isinstance(table, Clusters) else len(table.index.clusters)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvreel dre", description="run the DRE service standalone")
    ap.add_argument("--address", required=True,
                    help="a Unix-socket path, or host:port (host defaults to 127.0.0.1)")
    ap.add_argument("--bits", type=int, default=HASH_BITS)
    ap.add_argument("--hamming", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, help="exit when this process is gone (set by DREProcess)")
    ap.add_argument("--threads", type=int, help="torch threads for clustering (default: torch's)")
    ap.add_argument("--nice", type=int, default=0, help="lower the service's CPU priority by this much")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.nice:
        os.nice(a.nice)
    try:
        secret = parse_secret_hex(os.environ.get("KVREEL_DRE_SECRET_HEX"))
    except ValueError as e:
        print(f"kvreel dre: KVREEL_DRE_SECRET_HEX {e}", file=sys.stderr)
        return 2
    try:
        DREService(a.bits, a.hamming, secret).serve(a.address, a.parent_pid)
    except DREError as e:
        print(f"kvreel dre: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
