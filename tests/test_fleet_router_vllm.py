"""Two vLLM engines with kvreel behind vllm-router's ``kv_aware`` policy, fed by
vLLM's own KV event publisher: a prefix that left an engine's paged cache (other
prompts pushed it out) is routed back to the engine whose kvreel host tier holds
it, and served from there. Loopback only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from bench.common import zmq_relay
from conftest import tokens
from kvreel.cli.serve import CONNECTOR_JSON
from kvreel.cli.server_process import free_port, stop_server, wait_healthy

pytestmark = pytest.mark.vllm
BS = 32


def _complete(base: str, model: str, prompt: list[int]) -> int:
    """Cached prompt tokens of one greedy completion."""
    req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"}, data=json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode())
    usage = json.loads(urllib.request.urlopen(req, timeout=120).read())["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _host_hits(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:kvreel_lookup_hit_blocks_total" and s.labels.get("tier") == "host")


def test_router_sends_an_evicted_prefix_to_the_engine_whose_kvreel_holds_it(tiny_model, tmp_path):
    router_exe = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    assert router_exe, "vllm-router is not installed (deploy/setup.sh installs vllm-router==0.1.17)"
    engines, router = [], None
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    env.update(PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1", KVREEL_CPU_BYTES="256MiB")
    try:
        for i in range(2):
            publish, subscribe = zmq_relay()
            port = free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
                   "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BS), "--max-model-len", "2048",
                   "--enforce-eager", "--enable-prompt-tokens-details", "--num-gpu-blocks-override", "80",
                   "--gpu-memory-utilization", "0.05", "--kv-transfer-config", CONNECTOR_JSON,
                   "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                     "endpoint": publish})]
            log = open(tmp_path / f"engine{i}.log", "w")
            engines.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True), f"http://127.0.0.1:{port}", subscribe))
        for proc, base, _ in engines:
            assert wait_healthy(proc, base) is None, (tmp_path / "engine0.log").read_text()[-3000:]
        port = free_port()
        cmd = [router_exe, "--policy", "kv_aware", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *[base for _, base, _ in engines],
               "--kv-event-block-size", str(BS), "--kv-event-model", tiny_model]
        for _, base, subscribe in engines:
            cmd += ["--kv-event-source", f"{base}={subscribe}"]
        router = subprocess.Popen(cmd, stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        routed = f"http://127.0.0.1:{port}"
        assert wait_healthy(router, routed, timeout_s=60) is None, (tmp_path / "router.log").read_text()[-3000:]

        prefixes = [tokens(700, s) for s in range(4)]            # 21 full blocks each
        for k, prefix in enumerate(prefixes):                     # placed two per engine
            _complete(engines[k % 2][1], tiny_model, prefix + tokens(20, 100 + k))
        for j in range(6):                                        # pushed out of both paged caches (80 blocks)
            for e, (_, base, _) in enumerate(engines):
                _complete(base, tiny_model, tokens(900, 1000 + 2 * j + e))
        time.sleep(1)                                             # the last events reach the router
        before = sum(_host_hits(base) for _, base, _ in engines)
        cached = [_complete(routed, tiny_model, prefix + tokens(20, 300 + k)) for k, prefix in enumerate(prefixes)]
        assert cached == [21 * BS] * 4, cached                    # each went back to the engine holding it ...
        assert sum(_host_hits(base) for _, base, _ in engines) - before == 4 * 21   # ... served by kvreel's host tier
    finally:
        if router is not None:
            stop_server(router)
        for proc, _, _ in engines:
            stop_server(proc)
