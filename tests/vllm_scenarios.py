"""Engine scenarios for the exactness tests, run in a fresh process each:
``python tests/vllm_scenarios.py NAME ARGS_JSON OUT_JSON``.

vLLM spawns its engine and worker processes; running every scenario in its own
interpreter keeps pytest's process free of engine state and memory.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

from kvreel.cli.serve import CONNECTOR


def make_llm(model: str, *, kvreel: dict | None, num_blocks: int | None = None, block_size: int = 32,
             max_num_seqs: int = 16, max_model_len: int | None = None, connector: dict | None = None,
             max_num_batched_tokens: int | None = None, disable_hybrid_kv_cache_manager: bool | None = None,
             kv_events: str | None = None):
    """An engine with kvreel (``kvreel``: its extra config) or another connector
    (``connector``: a whole kv_transfer_config), or neither. With ``num_blocks``
    the model length defaults to what those blocks hold (a long session with its
    history in kvreel may be longer: pass ``max_model_len``). ``kv_events``: the
    endpoint vLLM's ZMQ publisher binds for its KV cache events."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kw = {}
    if kvreel is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=kvreel)
    elif connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**connector)
    if num_blocks:
        kw["num_gpu_blocks_override"] = num_blocks
    if max_model_len is None:
        max_model_len = min(4096, (num_blocks - 1) * block_size) if num_blocks else 4096
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    if disable_hybrid_kv_cache_manager is not None:
        kw["disable_hybrid_kv_cache_manager"] = disable_hybrid_kv_cache_manager
    if kv_events:
        from vllm.config import KVEventsConfig
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events)
    return LLM(model, enforce_eager=True, block_size=block_size, max_model_len=max_model_len,
               gpu_memory_utilization=0.05, max_num_seqs=max_num_seqs, seed=0,
               disable_log_stats=False, **kw)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    time.sleep(1)


def run(llm, prompts: list[list[int]], max_tokens: int, hints: list[dict | None] | None = None) -> list[dict]:
    """Greedy outputs; ``hints[i]``: prompt i's ``kv_transfer_params``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sps = [SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True,
                          extra_args={"kv_transfer_params": h} if h else None)
           for h in (hints or [None] * len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append({
            "token_ids": list(c.token_ids),
            # float.hex: bit-exact comparison survives JSON
            "logprobs": [sorted((tid, lp.logprob.hex()) for tid, lp in step.items()) for step in c.logprobs],
            "num_cached_tokens": o.num_cached_tokens,
        })
    return res


def kvreel_metrics(llm) -> dict:
    """Counters of kvreel from vLLM's Prometheus registry (what /metrics serves)."""
    from prometheus_client import REGISTRY
    out: dict = {}
    for metric in REGISTRY.collect():
        if metric.name.startswith("vllm:kvreel_") or metric.name == "vllm:num_preemptions":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    label = next((s.labels[k] for k in ("tier", "form", "outcome", "how", "result", "by")
                                  if k in s.labels), "")
                    out[f"{s.name}|{label}" if label else s.name] = s.value
    return out


def track_kv_bytes(llm) -> list[float]:
    """Bytes of vLLM's paged KV cache in use after each scheduling step (vLLM's
    usage times its one backing allocation; engine core in this process only:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the list grows as the engine runs."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    allocation = scheduler.kv_cache_config.kv_cache_tensors[0].size
    seen: list[float] = []
    schedule = scheduler.schedule

    def schedule_and_record(*args, **kwargs):
        out = schedule(*args, **kwargs)
        seen.append(scheduler.kv_cache_manager.usage * allocation)
        return out

    scheduler.schedule = schedule_and_record
    return seen


class EventSubscriber:
    """vLLM's KV cache events from its ZMQ publisher, decoded with vLLM's own
    classes; ``take`` returns those received so far as JSON-friendly dicts."""

    def __init__(self, endpoint: str):
        import zmq
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)

    def take(self, settle_s: float = 1.0) -> list[dict]:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        out = []
        while self._sock.poll(int(settle_s * 1000), zmq.POLLIN):
            _topic, _seq, payload = self._sock.recv_multipart()
            for ev in decoder.decode(payload).events:
                row = {"kind": type(ev).__name__}
                for field in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "locality"):
                    if hasattr(ev, field):
                        row[field] = getattr(ev, field)
                out.append(row)
        return out


def kill_matching(program: str) -> None:
    """SIGKILL every process this scenario started (its descendants) with
    ``program`` as one whole argument of its command line (``python -m program``;
    forked engine processes carry this script's arguments, which only contain
    it). Processes of tests running beside this one are left alone."""
    import signal
    from pathlib import Path

    def parent(pid: str) -> str:
        stat = (Path("/proc") / pid / "stat").read_text()
        return stat.rpartition(")")[2].split()[1]      # the command name may hold spaces and ")"

    mine = str(os.getpid())
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or proc.name == mine:
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if program.encode() not in argv:
                continue
            ancestor = parent(proc.name)
            while ancestor not in (mine, "0", "1"):
                ancestor = parent(ancestor)
        except OSError:
            continue
        if ancestor == mine:
            os.kill(int(proc.name), signal.SIGKILL)
            killed += 1
    assert killed, f"no process of this scenario runs {program!r}"


def track_block_ids(llm) -> dict[int, list[int]]:
    """Block ids (first KV cache group) of each running request by prompt
    length, as last scheduled (engine core in this process only)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    seen: dict[int, list[int]] = {}
    schedule = scheduler.schedule

    def schedule_and_record(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for req in scheduler.running:
            seen[len(req.prompt_token_ids)] = list(scheduler.kv_cache_manager.get_block_ids(req.request_id)[0])
        return out

    scheduler.schedule = schedule_and_record
    return seen


def _page_digests(worker, block_ids: list[int]) -> list[str]:
    """Run in the worker (vLLM's ``collective_rpc``): a digest of each block's page over every layer."""
    import hashlib

    import torch
    caches = worker.model_runner.kv_caches          # per layer: [blocks, ...] pages
    return [hashlib.sha256(b"".join(c[b].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                    for c in caches)).hexdigest() for b in block_ids]


def _fill_pages(worker, byte: int) -> None:
    import torch
    for c in worker.model_runner.kv_caches:
        c.view(-1).view(torch.uint8).fill_(byte)


def restored_pages(args: dict) -> dict:
    """The pages of every full prompt block, as the engine computed them (digests
    over all layers), then after vLLM's prefix cache was reset, every page of the
    cache overwritten with one byte value, and the prompts served again from kvreel."""
    bs = args["block_size"]
    llm = make_llm(args["model"], kvreel=args["kvreel"], block_size=bs)
    ids = track_block_ids(llm)
    out: dict = {}
    for phase in ("computed", "restored"):
        if phase == "restored":
            assert llm.reset_prefix_cache()
            llm.collective_rpc(_fill_pages, args=(0x5A,))
        res = run(llm, args["prompts"], args.get("max_tokens", 12))
        out[phase] = {"outputs": res, "block_ids": [ids[len(p)] for p in args["prompts"]],
                      "pages": [llm.collective_rpc(_page_digests, args=(ids[len(p)][:(len(p) - 1) // bs],))[0]
                                for p in args["prompts"]]}
    out["metrics"] = kvreel_metrics(llm)
    close(llm)
    return out


def scenario(args: dict) -> dict:
    """Run ``phases`` on one engine; each phase: prompts, after optional actions
    (``before``: one or a list of reset_prefix_cache, restart, kill:PROGRAM, shell:COMMAND).
    With ``kv_events`` (an endpoint), the KV cache events published during each phase too."""
    model = args["model"]
    kvreel = args.get("kvreel")
    out = {"phases": []}
    engine = {k: args[k] for k in ("num_blocks", "block_size", "max_num_seqs", "max_model_len",
                                   "max_num_batched_tokens", "disable_hybrid_kv_cache_manager", "kv_events")
              if k in args}
    events = EventSubscriber(args["kv_events"]) if "kv_events" in args else None
    llm = make_llm(model, kvreel=kvreel, connector=args.get("connector"), **engine)
    kv_bytes = track_kv_bytes(llm) if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else None
    for phase in args["phases"]:
        before = phase.get("before") or []
        for action in [before] if isinstance(before, str) else before:
            if action == "reset_prefix_cache":
                assert llm.reset_prefix_cache()
            elif action == "restart":
                close(llm)
                llm = make_llm(model, kvreel=kvreel, connector=args.get("connector"), **engine)
                kv_bytes = track_kv_bytes(llm) if kv_bytes is not None else None
            elif action.startswith("kill:"):
                kill_matching(action[len("kill:"):])
            elif action.startswith("shell:"):
                import subprocess
                subprocess.run(action[len("shell:"):], shell=True, check=True)
        if kv_bytes is not None:
            kv_bytes.clear()
        out["phases"].append(run(llm, phase["prompts"], phase.get("max_tokens", 8), phase.get("hints")))
        if events is not None:
            out.setdefault("events", []).append(events.take())
        if kv_bytes is not None:
            out.setdefault("peak_kv_bytes", []).append(max(kv_bytes, default=0.0))
    out["metrics"] = kvreel_metrics(llm)
    close(llm)
    return out


if __name__ == "__main__":
    name, args_json, out_path = sys.argv[1:4]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = {"scenario": scenario, "restored_pages": restored_pages}[name](json.loads(args_json))
    with open(out_path, "w") as f:
        json.dump(result, f)
