"""A loopback TCP proxy that limits throughput (token bucket) and can replay a
bandwidth trace (e.g. 6 -> 3 -> 4 Gbps with jitter), for tests and benchmarks
of remote fetching. It listens on 127.0.0.1 only and forwards to one upstream.

    with Shaper(("127.0.0.1", redis_port), rate_Bps=50e6) as proxy:
        store = open_store(f"redis://127.0.0.1:{proxy.port}/0")
"""

from __future__ import annotations

import random
import socket
import threading
import time


class TokenBucket:
    def __init__(self, rate_Bps: float, burst: int = 64 * 1024):
        self.rate = float(rate_Bps)
        self.burst = burst
        self.tokens = float(burst)
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def set_rate(self, rate_Bps: float) -> None:
        with self.lock:
            self.rate = float(rate_Bps)

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may pass. A send larger than the burst waits
        for a full bucket and leaves a debt, so the average rate still holds."""
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
                self.t = now
                need = min(n, self.burst)
                if self.tokens >= need:
                    self.tokens -= n
                    return
                wait = (need - self.tokens) / self.rate
            time.sleep(min(wait, 0.05))


class Shaper:
    """Downstream (upstream -> client) bytes pass the token bucket; requests flow freely."""

    def __init__(self, upstream: tuple[str, int], rate_Bps: float, *, trace: list[tuple[float, float]] | None = None,
                 jitter: float = 0.0, chunk: int = 16 * 1024, seed: int = 0, cut_after_bytes: int | None = None):
        """``cut_after_bytes``: drop every connection once that many bytes went
        downstream on it (a link cut mid-transfer, for fault tests)."""
        self.upstream = upstream
        self.bucket = TokenBucket(rate_Bps, burst=max(chunk, 64 * 1024))
        self.trace = trace or []            # [(seconds, rate_Bps), ...] replayed in a loop
        self.jitter = jitter
        self.chunk = chunk
        self.cut_after_bytes = cut_after_bytes
        self._rng = random.Random(seed)
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        for target in (self._accept, self._replay):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()

    def _replay(self) -> None:
        """Replay ``trace`` in a loop; a trace set (or cleared) later takes effect too."""
        while not self._stop.is_set():
            trace = list(self.trace)
            if not trace:
                self._stop.wait(0.05)
                continue
            for seconds, rate in trace:
                factor = 1.0 + self._rng.uniform(-self.jitter, self.jitter) if self.jitter else 1.0
                self.bucket.set_rate(rate * factor)
                if self._stop.wait(seconds) or not self.trace:
                    break

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            for src, dst, shaped in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pipe, args=(src, dst, shaped), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, shaped: bool) -> None:
        sent = 0
        try:
            while not self._stop.is_set():
                data = src.recv(self.chunk)
                if not data:
                    break
                if shaped:
                    if self.cut_after_bytes is not None and sent + len(data) > self.cut_after_bytes:
                        dst.sendall(data[: max(0, self.cut_after_bytes - sent)])
                        break
                    self.bucket.take(len(data))
                    sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
