from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvreel.cli.server_process import free_port

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))        # bench/ helpers (the loopback shaper) are shared with the tests

__all__ = ["free_port", "run_scenario", "tokens"]


def has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _start_rank(item) -> int:
    return 0 if "docker" in item.keywords else 1 if "vllm" in item.keywords else 2


def pytest_collection_modifyitems(config, items):
    # Files that start the Docker stack, then those that start engines, then the
    # quick ones (a file's tests stay together and in order): with two files at a
    # time (`-n 2 --dist loadfile --no-loadscope-reorder`, which keeps this order;
    # xdist's own puts the files with most tests first), the 8-minute Docker stack
    # starts at once and quick files fill the end. Started last, it ran alone at
    # the end (on the AMX Xeon: CI 42 minutes, 33 where it happened to start early).
    rank: dict[Path, int] = {}
    for item in items:
        rank[item.path] = min(rank.get(item.path, 2), _start_rank(item))
    items.sort(key=lambda item: rank[item.path])
    if not has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama with GQA, built locally (no model hub needed)."""
    from kvreel.cli.tiny_model import build_tiny_llama
    cache = os.environ.get("KVREEL_TEST_MODEL_CACHE")  # lets local reruns skip the build
    out = Path(cache) if cache else tmp_path_factory.mktemp("tiny-llama")
    return str(build_tiny_llama(out))


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory) -> str:
    """A 4-layer random Llama twice as wide: its matrix products are large enough
    that their bf16 bits depend on the engine's thread count on some CPUs."""
    from kvreel.cli.tiny_model import build_tiny_llama
    cache = os.environ.get("KVREEL_TEST_MODEL_CACHE")
    out = Path(cache) / "wide" if cache else tmp_path_factory.mktemp("wide-llama")
    return str(build_tiny_llama(out, num_layers=4, hidden_size=512, num_heads=8, seed=7))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def first_error(log: str, lines: int = 60) -> str:
    """What ``log`` says about the first engine process that died: the lines that
    report a death (vLLM's worker monitor, a signal), then a fatal error's stack
    (faulthandler) or else the first traceback (the tail shows only what the
    others said after)."""
    text = log.splitlines()
    deaths = [line for line in text if any(sign in line for sign in ("died unexpectedly", "Segmentation fault",
                                                                      "Killed", "exit code"))]
    at = next((i for i, line in enumerate(text) if "Fatal Python error" in line), None)
    if at is None:
        at = next((i for i, line in enumerate(text) if "Traceback (most recent call last)" in line), None)
    stack = "(no traceback)" if at is None else "\n".join(text[at:at + lines])
    return "\n".join(deaths[:10] + [stack])


def run_scenario(args: dict, timeout: int = 600, name: str = "scenario") -> dict:
    """Run tests/vllm_scenarios.py's ``name`` in a fresh interpreter and return its JSON."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        # Engines run on vLLM's own CPU split, as a user's do: kvreel's engine must
        # compute on the threads plain vLLM's does (bf16 bits depend on the count).
        # The engine core runs in the scenario's process, as in vLLM's own tests: an
        # engine starts in ~3 s instead of ~25 s (no second interpreter importing
        # vLLM), and a phase's prompts all reach the scheduler before its first step,
        # so batches, and with them logprobs' last bits, do not depend on timing.
        # ``vllm serve`` with its engine process is tested by the demo, CLI, fleet
        # and Docker tests.
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")},
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "PYTHONFAULTHANDLER": "1",      # a native crash in any engine process prints its stack
               **args.get("env", {})}      # e.g. KVREEL_RETRIEVAL, read by kvreel's vLLM plugin
        proc = subprocess.run([sys.executable, str(HERE / "vllm_scenarios.py"), name, json.dumps(args),
                               str(out)], env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"scenario failed (rc={proc.returncode}); its first error:\n"
                                 f"{first_error(proc.stdout + proc.stderr)}\n--- its last output:\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        result = json.loads(out.read_text())
        result["log"] = proc.stdout + proc.stderr
        return result




@pytest.fixture
def redis_server(tmp_path):
    """A real Redis (Debian's redis-server) on loopback with a password; yields (process, port)."""
    import shutil
    from bench.common import wait_port
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (Debian package redis-server; deploy/setup.sh installs it as root)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path), "--requirepass", "s3cret"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, "redis-server", timeout=10)
    yield proc, port
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def redis_cluster(tmp_path):
    """A Redis Cluster on loopback: 3 masters and 3 replicas of Debian's redis-server,
    made with ``redis-cli --cluster create``, password ``s3cret``, failover after 1 s.
    Yields {port: process}."""
    from bench.common import start_redis_cluster, stop_all
    try:
        nodes = start_redis_cluster(tmp_path / "cluster", masters=3, replicas=1, password="s3cret")
    except RuntimeError as e:
        pytest.fail(str(e))
    yield nodes
    stop_all(nodes.values())
