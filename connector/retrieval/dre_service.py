"""The DRE: the expensive part of retrieval (ReSV's hash-bit clustering, Mosaic's
nested k-means, online assignment and splits) as an asynchronous co-processor
service in its own process. It never sits on a step's critical path: it labels
each history token with its cluster, and the worker rebuilds the history's
slabs in cluster order with those labels; every step's selection is made in
the worker from the step's own queries (``kvreel.connector.retrieval.runtime``).

Wire: a Unix-domain socket (or TCP on 127.0.0.1 unless told otherwise) carrying
length-prefixed frames: a JSON message and the raw bytes of its tensors. When
both ends share an IPC namespace (same host, same container), a tensor goes
through a POSIX shared-memory segment the sender names and the receiver copies
out and unlinks; otherwise (the DRE in a container of its own, or on another
host) it travels inline, after the JSON. The client compares its namespace
with the one the service announces and asks for replies the same way. Nothing
is pickled. With a shared secret, a connection must first prove it (HMAC of a
server nonce) before any request is served.

Requests (each answered once, in any order, matched by ``id``), one table per
``handle`` (a request's layer, all its KV heads):

* ``cluster``  keys ``[heads, T, D]`` of a history and ``method`` resv (HC table)
  or mosaic (centroid index) -> the table; reply: each token's cluster
  ``labels`` ``[heads, T]``.
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
import ipaddress
import json
import logging
import os
import re
import secrets
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from kvreel.connector.retrieval.mosaic import MosaicSession
from kvreel.connector.retrieval.resv import Clusters, cluster_keys, extend_clusters, hyperplanes

logger = logging.getLogger(__name__)
_FRAME = struct.Struct("<II")    # JSON bytes, inline tensor bytes
MAX_MESSAGE = 1 << 20            # the JSON part; tensors travel beside it
MAX_TENSOR_BYTES = 1 << 30
# ReSV hash bits (centred keys). The clusters narrow a long history to the tokens
# a step scores exactly (``LayerHistory.candidates``): ranking them must cost far
# less than scoring every token, so a layer has at most 2^bits of them; on
# SmolLM2-135M's keys 16 bits left nearly one cluster per token.
HASH_BITS = 12
DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_}


class DREError(RuntimeError):
    """The service refused a request, or is unreachable."""


# -- shared memory -------------------------------------------------------------

SHM_PREFIX = "kvreel-dre-"
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}\d+-[0-9a-f]{{16}}$")


def put_tensor(t: torch.Tensor) -> dict:
    """Copy a tensor into a new shared-memory segment; its descriptor (the
    receiver copies it out and unlinks the segment)."""
    arr = t.detach().cpu().contiguous().numpy()
    shm = shared_memory.SharedMemory(name=f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}", create=True,
                                     size=max(1, arr.nbytes))
    np.ndarray(arr.shape, arr.dtype, buffer=shm.buf)[...] = arr
    desc = {"shm": shm.name, "shape": list(arr.shape), "dtype": arr.dtype.name}
    # the receiver unlinks it; stop this process's tracker from unlinking it again at exit
    resource_tracker.unregister(shm._name, "shared_memory")
    shm.close()
    return desc


def inline_tensor(t: torch.Tensor, blob: bytearray) -> dict:
    """Append a tensor's bytes to a frame's inline part; its descriptor."""
    arr = t.detach().cpu().contiguous().numpy()
    desc = {"at": len(blob), "shape": list(arr.shape), "dtype": arr.dtype.name}
    blob += arr.tobytes()
    return desc


def take_tensor(desc: dict, blob: bytes = b"") -> torch.Tensor:
    """A tensor a peer sent: copied out of the frame's inline bytes, or out of
    the named segment (then unlinked). Only segments named as ``put_tensor``
    names them are opened: a peer must not make this process read or delete
    anyone else's shared memory (vLLM's included)."""
    dtype = DTYPES.get(str(desc.get("dtype")))
    shape = [int(x) for x in desc.get("shape", [])]
    if dtype is None or any(x < 0 for x in shape):
        raise DREError(f"bad tensor descriptor {str(desc)[:120]}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise DREError(f"tensor of {nbytes} bytes exceeds the {MAX_TENSOR_BYTES}-byte limit")
    if "at" in desc:
        at = int(desc["at"])
        if at < 0 or at + nbytes > len(blob):
            raise DREError("inline tensor outside its frame")
        return torch.from_numpy(np.frombuffer(blob, dtype, count=nbytes // np.dtype(dtype).itemsize,
                                              offset=at).reshape(shape).copy())
    if not _SHM_NAME.match(str(desc.get("shm"))):
        raise DREError(f"refused shared-memory segment {str(desc.get('shm'))[:80]!r}: not one kvreel created")
    shm = shared_memory.SharedMemory(name=str(desc["shm"]))
    try:
        if shm.size < nbytes:
            raise DREError("shared-memory segment smaller than its descriptor")
        out = torch.from_numpy(np.ndarray(shape, dtype, buffer=shm.buf).copy())
    finally:
        shm.close()
        shm.unlink()
    return out


def ipc_namespace() -> str | None:
    """This process's IPC namespace (with the host's boot id): shared-memory
    segments reach exactly the processes that report the same."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.readlink('/proc/self/ns/ipc')}"
    except OSError:
        return None


def encode_tensors(msg: dict, inline: bool) -> tuple[dict, bytes]:
    """A message's tensors as shared-memory descriptors, or inline after its JSON."""
    blob = bytearray()
    out = {k: (inline_tensor(v, blob) if inline else put_tensor(v)) if isinstance(v, torch.Tensor) else v
           for k, v in msg.items()}
    return out, bytes(blob)


def decode_tensors(msg: dict, blob: bytes) -> dict:
    return {k: take_tensor(v, blob) if isinstance(v, dict) and ("shm" in v or "at" in v) else v
            for k, v in msg.items()}


# -- framing -------------------------------------------------------------------

def send_msg(sock: socket.socket, msg: dict, blob: bytes = b"") -> None:
    raw = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(len(raw), len(blob)) + raw + blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("connection closed")
        buf += part
    return bytes(buf)


def recv_msg(sock: socket.socket, max_blob: int = MAX_TENSOR_BYTES) -> tuple[dict, bytes]:
    """A message and its inline tensor bytes (at most ``max_blob`` of them)."""
    n, nblob = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if n > MAX_MESSAGE:
        raise DREError(f"message of {n} bytes exceeds the {MAX_MESSAGE}-byte limit")
    if nblob > max_blob:
        raise DREError(f"{nblob} inline bytes exceed the {max_blob}-byte limit")
    msg = json.loads(_recv_exact(sock, n))
    if not isinstance(msg, dict):
        raise DREError("message is not a JSON object")
    return msg, _recv_exact(sock, nblob) if nblob else b""


def _proof(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, nonce.encode(), "sha256").hexdigest()


# -- the service -----------------------------------------------------------------

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
            else:
                tables, first = self._table(handle)
                if keys.shape[0] != len(tables):
                    raise DREError(f"extend wants keys of {len(tables)} heads, got {tuple(keys.shape)}")
                fetched = _fetched(msg, len(tables))
                for i, (k, table) in enumerate(zip(keys, tables)):
                    if isinstance(table, Clusters):
                        tables[i] = extend_clusters(table, k, self._planes_for(k), self.hamming)
                    else:
                        table.extend(k)
                        if fetched is not None:
                            split |= table.after_fetch(fetched[i][(fetched[i] >= 0)
                                                                  & (fetched[i] < len(table.index.clusters))])
            n_tokens = first + keys.shape[1]
            self.tables[handle] = (tables, n_tokens)
            reply = {"ok": True, "clusters": sum(_num_clusters(t) for t in tables),
                     "labels": torch.stack([_owners(t, n_tokens)[first:] for t in tables])}
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
        if self.secret is None and not _is_private(address):
            raise DREError(f"refusing to serve {address} without a shared secret: anyone who reaches it could "
                           "use the service; set KVREEL_DRE_SECRET_HEX, or listen on loopback or a Unix socket")
        listener = _listen(address)
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
                                                                         _proof(self.secret, nonce))
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


def _is_private(address: str) -> bool:
    """A Unix socket (file permissions guard it) or a loopback TCP address."""
    if "/" in address:
        return True
    host = address.rpartition(":")[0].strip("[]") or "127.0.0.1"
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def _listen(address: str) -> socket.socket:
    if "/" in address:
        if os.path.exists(address):
            os.unlink(address)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        os.chmod(address, 0o600)
    else:
        host, _, port = address.rpartition(":")
        s = socket.create_server((host or "127.0.0.1", int(port)))
    s.listen(16)
    return s


def _connect(address: str, timeout: float) -> socket.socket:
    if "/" in address:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(address)
    else:
        host, _, port = address.rpartition(":")
        s = socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout)
    s.settimeout(None)
    return s


# -- the client ------------------------------------------------------------------

class DREClient:
    """submit(op, **fields) -> Future of the reply (tensors already copied out)."""

    def __init__(self, address: str, secret: bytes | None = None, connect_timeout: float = 5.0):
        self.sock = _connect(address, connect_timeout)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next = 0
        self.alive = True
        hello, _ = recv_msg(self.sock)
        if hello.get("nonce"):
            if secret is None:
                raise DREError("the DRE service requires a shared secret")
            send_msg(self.sock, {"op": "auth", "id": -1, "proof": _proof(secret, hello["nonce"])})
            if not recv_msg(self.sock)[0].get("ok"):
                raise DREError("the DRE service refused the shared secret")
        here = ipc_namespace()
        # shared memory only reaches a service in this IPC namespace; anywhere else tensors go inline
        self.inline = here is None or hello.get("ipc") != here
        self._reader = threading.Thread(target=self._read, name="kvreel-dre-client", daemon=True)
        self._reader.start()

    def submit(self, op: str, **fields) -> Future:
        fut: Future = Future()
        msg, blob = encode_tensors({"op": op, **fields, "inline": self.inline}, self.inline)
        with self._lock:
            if not self.alive:
                fut.set_exception(DREError("the DRE service is gone"))
                return fut
            msg["id"] = self._next
            self._pending[self._next] = fut
            self._next += 1
            try:
                send_msg(self.sock, msg, blob)
            except OSError as e:
                self._pending.pop(msg["id"], None)
                fut.set_exception(DREError(f"the DRE service is unreachable: {e}"))
        return fut

    def _read(self) -> None:
        try:
            while True:
                reply, blob = recv_msg(self.sock)
                with self._lock:
                    fut = self._pending.pop(reply.get("id"), None)
                if fut is None:
                    continue
                if not reply.get("ok"):
                    fut.set_exception(DREError(reply.get("error", "request failed")))
                    continue
                fut.set_result(decode_tensors(reply, blob))
        except (ConnectionError, OSError, DREError, ValueError):
            pass
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(DREError("the DRE service died"))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class DREProcess:
    """Starts the service as a child process, and restarts it when it dies."""

    def __init__(self, address: str, secret: bytes | None = None, bits: int = HASH_BITS, hamming: int = 0):
        self.address, self.secret, self.bits, self.hamming = address, secret, bits, hamming
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self, timeout: float = 30.0) -> DREClient:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        if self.secret:
            env["KVREEL_DRE_SECRET_HEX"] = self.secret.hex()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvreel.connector.retrieval.dre_service",
                                      "--address", self.address, "--bits", str(self.bits),
                                      "--hamming", str(self.hamming), "--parent-pid", str(os.getpid()),
                                      # beside the engine on its cores: one thread, and it yields to the
                                      # engine (decode never waits for a prediction; prefill waits idle)
                                      "--threads", "1", "--nice", "10"],
                                     env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return DREClient(self.address, self.secret)
            except (OSError, DREError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise DREError(f"the DRE service did not start (exit {self.proc.poll()})") from None
                time.sleep(0.05)

    def ensure(self, client: DREClient | None) -> DREClient:
        """The live client, or a new one after restarting a dead service."""
        if client is not None and client.alive and self.proc is not None and self.proc.poll() is None:
            return client
        if client is not None:
            client.close()
        self.stop()
        self.restarts += 1
        logger.warning("kvreel: DRE service died; restarting it (restart %d)", self.restarts)
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


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
    hex_secret = os.environ.get("KVREEL_DRE_SECRET_HEX")
    secret = bytes.fromhex(hex_secret) if hex_secret else None
    try:
        DREService(a.bits, a.hamming, secret).serve(a.address, a.parent_pid)
    except DREError as e:
        print(f"kvreel dre: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
