"""The worker's side of the DRE: a client that sends requests and completes
their futures from a reader thread, and the child process a worker starts when
no ``KVREEL_DRE_ADDRESS`` is given."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from kvreel.dre.wire import (DREError, connect, decode_tensors, discard_orphaned_segments,
                             discard_segments, encode_tensors, ipc_namespace, proof, recv_msg,
                             segment_names, send_msg)
from kvreel.dre.resv import HASH_BITS


class DREClient:
    """submit(op, **fields) -> Future of the reply (tensors already copied out)."""

    def __init__(self, address: str, secret: bytes | None = None, connect_timeout: float = 5.0):
        self.sock = connect(address, connect_timeout)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, list[str]]] = {}     # id -> its reply, its segments
        self._next = 0
        self.alive = True
        hello, _ = recv_msg(self.sock)
        if hello.get("nonce"):
            if secret is None:
                raise DREError("the DRE service requires a shared secret")
            send_msg(self.sock, {"op": "auth", "id": -1, "proof": proof(secret, hello["nonce"])})
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
        segments = segment_names(msg)            # the DRE unlinks them as it reads; if it never does, we do
        with self._lock:
            if not self.alive:
                discard_segments(segments)
                fut.set_exception(DREError("the DRE service is gone"))
                return fut
            msg["id"] = self._next
            self._pending[self._next] = fut, segments
            self._next += 1
            try:
                send_msg(self.sock, msg, blob)
            except OSError as e:
                self._pending.pop(msg["id"], None)
                discard_segments(segments)
                fut.set_exception(DREError(f"the DRE service is unreachable: {e}"))
        return fut

    def _read(self) -> None:
        try:
            while True:
                reply, blob = recv_msg(self.sock)
                with self._lock:
                    fut, _ = self._pending.pop(reply.get("id"), (None, None))
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
        for fut, segments in pending.values():
            discard_segments(segments)          # those the DRE never took
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

    def start(self, timeout: float = 30.0) -> DREClient:
        discard_orphaned_segments()             # what a worker or DRE that died here left in flight
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        if self.secret:
            env["KVREEL_DRE_SECRET_HEX"] = self.secret.hex()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvreel.dre.service",
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

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

