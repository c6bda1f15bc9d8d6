from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvreel.connector.cli import free_port

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))        # bench/ helpers (the loopback shaper) are shared with the tests

__all__ = ["free_port", "run_scenario", "tokens"]


def has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if not has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama with GQA, built locally (no model hub needed)."""
    from kvreel.connector.tiny_model import build_tiny_llama
    cache = os.environ.get("KVREEL_TEST_MODEL_CACHE")  # lets local reruns skip the build
    out = Path(cache) if cache else tmp_path_factory.mktemp("tiny-llama")
    return str(build_tiny_llama(out))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def run_scenario(args: dict, timeout: int = 600) -> dict:
    """Run tests/vllm_scenarios.py in a fresh interpreter and return its JSON."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(args.get("env", {}))            # e.g. KVREEL_RETRIEVAL, read by kvreel's vLLM plugin
        proc = subprocess.run([sys.executable, str(HERE / "vllm_scenarios.py"), "scenario", json.dumps(args),
                               str(out)], env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"scenario failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        result = json.loads(out.read_text())
        result["log"] = proc.stdout + proc.stderr
        return result




@pytest.fixture
def redis_server(tmp_path):
    """A real Redis (Debian's redis-server) on loopback with a password; yields (process, port)."""
    import shutil
    import socket
    import time
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (Debian package redis-server; deploy/setup.sh installs it as root)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path), "--requirepass", "s3cret"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield proc, port
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def redis_cluster(tmp_path):
    """A Redis Cluster on loopback: 3 masters and 3 replicas of Debian's redis-server,
    made with ``redis-cli --cluster create``, password ``s3cret``, failover after 1 s.
    Yields {port: process}."""
    import shutil
    import socket
    import time
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        pytest.fail("redis-server / redis-cli are not installed (Debian package redis-server; "
                    "deploy/setup.sh installs it as root)")
    nodes = {}
    for i in range(6):
        port, home = free_port(), tmp_path / f"node{i}"
        home.mkdir()
        nodes[port] = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-port", str(free_port()),          # the default, port + 10000, may be past 65535
             "--cluster-node-timeout",
             "1000", "--cluster-config-file", str(home / "nodes.conf"), "--dir", str(home), "--save", "",
             "--appendonly", "no", "--repl-diskless-sync-delay", "0", "--requirepass", "s3cret", "--masterauth", "s3cret"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for port in nodes:
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
    try:
        made = subprocess.run([cli, "-a", "s3cret", "--no-auth-warning", "--cluster", "create",
                               *[f"127.0.0.1:{p}" for p in nodes], "--cluster-replicas", "1", "--cluster-yes"],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
        deadline = time.time() + 30
        while "cluster_state:ok" not in subprocess.run(
                [cli, "-a", "s3cret", "--no-auth-warning", "-p", str(next(iter(nodes))), "cluster", "info"],
                capture_output=True, text=True).stdout:
            assert time.time() < deadline, "the cluster did not reach cluster_state:ok"
            time.sleep(0.2)
        for port in nodes:          # replicas synced: only then can one take over from its master
            while True:
                info = subprocess.run([cli, "-a", "s3cret", "--no-auth-warning", "-p", str(port), "info", "replication"],
                                      capture_output=True, text=True).stdout
                if "role:master" in info or "master_link_status:up" in info:
                    break
                assert time.time() < deadline, f"the replica on port {port} did not sync with its master"
                time.sleep(0.2)
        yield nodes
    finally:
        for proc in nodes.values():
            proc.kill()
            proc.wait(timeout=30)
