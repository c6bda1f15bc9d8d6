"""Retrieval quality as served, on a trained model over real text, in one run.

1. In vLLM (teacher-forced): one long prompt, prefilled in small chunks so that
   every chunk past ``--min-tokens`` attends through kvreel's retrieval (its
   history offloaded, every step's working set chosen with its own queries);
   vLLM's prompt logprobs give, at every position past the threshold, the
   model's top-1 token. Agreement = share of positions whose top-1 equals full
   attention's (the same engine with retrieval off), and the mean |logprob
   difference| of the actual next token. The working set's share of the
   history is kvreel's own counters (kept / history blocks over every
   layer-step).
2. In vLLM, decoding as served: several prompts past the threshold, each
   followed by ``--decode`` greedy tokens through retrieval; full attention then
   teacher-forces each prompt + generated tokens, and agreement is the share of
   generated tokens it also ranks first. Full attention's own decoding, scored
   the same way, is the control (decode vs prefill numerics).
3. Outside vLLM, the same selection code on captured queries/keys/values
   (``choose_tokens`` over a ``LayerHistory`` labelled by the DRE service's
   clustering, the decode step's own queries, the real sink block and
   window): the relative attention-output error per layer and KV head at
   decode positions, mean and worst head, against the working set's share of
   the history.

    python bench/retrieval_served.py --model models/smollm2-135m

SmolLM2-135M comes from the PyPI GGUF (Q4_1, dequantized to bf16;
``bench/smollm2_model.py``): a caveat for every figure measured on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (CONNECTOR, engine_in_subprocess, engine_or_main, in_process_dre, load_results,  # noqa: E402
                    machine_words, python_source_corpus, report, retrieval_counters, save, save_figure)

MEASURES = ("connector", "scheduler", "dre")  # the package paths its figures measure (bench/report.py)



def engine_main(args: dict) -> None:
    """One engine: ``score`` teacher-forces each sequence (prompt logprobs: the
    top-1 token and the logprob of the actual next token at every position);
    ``generate`` decodes ``decode`` tokens greedily after each prompt."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    seqs = json.loads(Path(args["prompt"]).read_text())
    llm = LLM(args["model"], enforce_eager=True, block_size=32, max_model_len=args["max_model_len"],
              max_num_batched_tokens=args["chunk"], gpu_memory_utilization=0.05, max_num_seqs=len(seqs), seed=0,
              disable_log_stats=False,
              kv_transfer_config=KVTransferConfig(**CONNECTOR, kv_connector_extra_config={"cpu_bytes": "1GiB"}))
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in seqs]
    t0 = time.perf_counter()
    if args["mode"] == "generate":
        outs = llm.generate(prompts, SamplingParams(max_tokens=args["decode"], temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        result = {"generated": [list(o.outputs[0].token_ids) for o in outs]}
    else:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                            use_tqdm=False)
        result = {"top1": [], "actual": []}
        for ids, out in zip(seqs, outs):
            lps = out.prompt_logprobs
            result["top1"].append([-1] + [max(lp.items(), key=lambda kv: kv[1].logprob)[0] for lp in lps[1:]])
            result["actual"].append([0.0] + [lp[ids[pos]].logprob for pos, lp in enumerate(lps) if pos])
    result.update(wall_s=time.perf_counter() - t0, metrics=retrieval_counters())
    report(result)
    llm.llm_engine.engine_core.shutdown()


def run_engine(args: dict, env: dict) -> dict:
    got = engine_in_subprocess(__file__, args, {"VLLM_CPU_KVCACHE_SPACE": "2", **env}, timeout=7200)
    if "error" in got:
        raise RuntimeError(got["error"])
    return got


def served_share(got: dict) -> dict:
    """The working set's share of the history and the step outcomes, from kvreel's counters."""
    m = got["metrics"]
    kept, history = m.get("vllm:kvreel_retrieval_kept_blocks_total", 0), m.get(
        "vllm:kvreel_retrieval_history_blocks_total", 0)
    return {"working_set_share_of_history": kept / history if history else None,
            "steps": {k.split("|")[1]: v for k, v in m.items() if "retrieval_steps" in k}}


def agreement(ref: dict, got: dict, first: int) -> dict:
    """Teacher-forced: top-1 and actual-token logprob at every position from ``first``."""
    pairs = list(zip(ref["top1"][0][first:], got["top1"][0][first:]))
    diffs = [abs(a - b) for a, b in zip(ref["actual"][0][first:], got["actual"][0][first:])]
    return {"positions": len(pairs), "top1_agreement": sum(a == b for a, b in pairs) / len(pairs),
            "mean_abs_logprob_diff": sum(diffs) / len(diffs), **served_share(got), "wall_s": got["wall_s"]}


def generated_agreement(scored: dict, prompts: list[list[int]], gen: dict) -> dict:
    """Decoding as served: the share of generated tokens (each the engine's greedy
    top-1) that full attention, given the same sequence so far, also ranks first;
    ``scored`` is full attention teacher-forced over prompt + generated tokens."""
    same = total = 0
    for top1, prompt, tokens in zip(scored["top1"], prompts, gen["generated"]):
        ref = top1[len(prompt):len(prompt) + len(tokens)]
        same += sum(a == b for a, b in zip(ref, tokens))
        total += len(tokens)
    return {"positions": total, "top1_agreement": same / total, **served_share(gen), "wall_s": gen["wall_s"]}


# -- 2. attention-output error through the serving selection -----------------------------

def served_errors(model: str, ids: list[int], method: str, alpha: float, share: float, window: int,
                  positions: list[int], block: int = 32, budget_tokens: int = 4096, candidates: int = 4) -> dict:
    """Relative attention-output error of decode queries at ``positions`` when
    each layer attends to what the served selection keeps (``choose_tokens``
    with the step's own queries, the DRE's clusters narrowing the candidates)."""
    from kv_capture import capture_qkv_ids

    from kvreel.connector.retrieval.history import LayerHistory
    from kvreel.connector.retrieval.page_packing import PagePacking
    from kvreel.connector.retrieval.selection import choose_tokens
    from kvreel.connector.vllm_internals import cpu_attn_isa
    q_all, k_all, v_all = capture_qkv_ids(model, ids)          # [L, Hq, T, D], [L, Hkv, T, D]
    L, Hq, T, D = q_all.shape
    H = k_all.shape[1]
    G = Hq // H
    packing = PagePacking(block, D, torch.bfloat16, cpu_attn_isa(torch.bfloat16, block, D))
    call = in_process_dre()
    errors, shares = [], []
    for p in positions:
        hist_blocks = (p - window) // block                    # blocks that left the window (sink included)
        resident = torch.arange(hist_blocks * block, p + 1)    # window and the decoded token itself
        pages_kept = max(2, min(math.ceil(share * hist_blocks), budget_tokens // block))
        for layer in range(L):
            k = k_all[layer, :, :p + 1].transpose(0, 1).bfloat16()      # [tokens, H, D]
            v = v_all[layer, :, :p + 1].transpose(0, 1).bfloat16()
            pages = torch.zeros(hist_blocks, H, 2 * block, D, dtype=torch.bfloat16)
            packing.pack(k[:hist_blocks * block], v[:hist_blocks * block], pages, torch.arange(hist_blocks * block))
            lh = LayerHistory(H, block, D, torch.bfloat16, packing)
            keys = lh.append(pages, 0)
            handle = f"p{p}/{layer}"
            lh.set_labels(block, call("cluster", handle=handle, keys=keys, method=method)["labels"])
            call("drop", handle=handle)
            q = q_all[layer, :, p].view(H, G, D)
            kept = choose_tokens(lh, q, alpha, (pages_kept - 1) * block, candidates)
            shares.append(kept.shape[1] / (hist_blocks * block))
            for h in range(H):
                tokens = torch.cat([kept[h], resident])
                full = _attend(q[h], k_all[layer, h, :p + 1], v_all[layer, h, :p + 1])
                part = _attend(q[h], k_all[layer, h, tokens], v_all[layer, h, tokens])
                errors.append(((part - full).norm() / full.norm()).item())
    e = torch.tensor(errors)
    return {"positions": positions, "mean_error": e.mean().item(), "worst_head_error": e.max().item(),
            "p99_error": e.quantile(0.99).item(), "working_set_share_of_history": sum(shares) / len(shares)}


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    w = torch.softmax(q.float() @ k.float().T / math.sqrt(q.shape[-1]), dim=-1)
    return w @ v.float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=7168)
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk: how finely the prompt is stepped")
    ap.add_argument("--min-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--configs", default="resv:0.9:0.125,mosaic:0.9:0.125,resv:0.9:0.25,mosaic:0.9:0.25",
                    help="method:alpha:budget share, comma separated")
    ap.add_argument("--error-positions", default="3089,4117,5141,6163,7061",
                    help="decode positions for the attention-output error (not block-aligned: the prediction "
                         "then comes from an earlier token, as served)")
    ap.add_argument("--decode-prompts", default="3072,4096,5120,6144",
                    help="decoding as served: prompt lengths (disjoint source text), decoded together")
    ap.add_argument("--decode", type=int, default=512, help="tokens generated after each decode prompt")
    ap.add_argument("--decode-chunk", type=int, default=512, help="prefill chunk of the decode prompts")
    ap.add_argument("--name", default=None)
    ap.add_argument("--replot", metavar="NAME", help="only redraw results/NAME.png from results/NAME.json")
    a = ap.parse_args()
    if a.replot:
        _plot(a.replot, load_results(a.replot))
        return
    if not a.model:
        ap.error("--model is required (or --replot NAME)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    lengths = [int(x) for x in a.decode_prompts.split(",")]
    corpus = tok(python_source_corpus(6 * (a.tokens + sum(lengths))))["input_ids"]
    ids = corpus[:a.tokens]
    decode_prompts, at = [], a.tokens
    for n in lengths:
        decode_prompts.append(corpus[at:at + n])
        at += n
    if at > len(corpus):
        raise SystemExit(f"the corpus holds {len(corpus)} tokens, {at} wanted")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kvreel-served"
    work.mkdir(exist_ok=True)

    def engine(mode: str, seqs: list[list[int]], chunk: int, env: dict) -> dict:
        path = work / f"{mode}.json"
        path.write_text(json.dumps(seqs))
        return run_engine({"model": a.model, "prompt": str(path), "chunk": chunk, "mode": mode, "decode": a.decode,
                           "max_model_len": max(a.tokens, max(lengths) + a.decode) + 64}, env)

    def decoded_and_scored(env: dict) -> tuple[dict, dict]:
        gen = engine("generate", decode_prompts, a.decode_chunk, env)
        full = engine("score", [p + g for p, g in zip(decode_prompts, gen["generated"])], a.decode_chunk, {})
        return gen, full

    print("== full attention", flush=True)
    ref = engine("score", [ids], a.chunk, {})
    gen, full = decoded_and_scored({})
    results = {"full attention": {"wall_s": ref["wall_s"],
                                  "decoding, as a control (decode vs teacher-forced numerics)":
                                      generated_agreement(full, decode_prompts, gen)}}
    configs = [c.split(":") for c in a.configs.split(",")]
    for method, alpha, share in configs:
        label = f"{method} alpha={alpha} share={share}"
        print(f"== {label}", flush=True)
        env = {"KVREEL_RETRIEVAL": method, "KVREEL_RETRIEVAL_ALPHA": alpha, "KVREEL_RETRIEVAL_BUDGET_SHARE": share,
               "KVREEL_RETRIEVAL_MIN_TOKENS": str(a.min_tokens), "KVREEL_RETRIEVAL_WINDOW": str(a.window)}
        results[label] = {"teacher_forced": agreement(ref, engine("score", [ids], a.chunk, env), a.min_tokens)}
        print(json.dumps(results[label]), flush=True)
        gen, full = decoded_and_scored(env)
        results[label]["decoding"] = generated_agreement(full, decode_prompts, gen)
        print(json.dumps(results[label]["decoding"]), flush=True)
        results[label]["attention_error"] = served_errors(
            a.model, ids, method, float(alpha), float(share), a.window,
            [int(x) for x in a.error_positions.split(",")])
        print(json.dumps(results[label]["attention_error"]), flush=True)
    name = a.name or f"retrieval_served_{Path(a.model).name}"
    settings = {k: getattr(a, k) for k in ("tokens", "chunk", "min_tokens", "window", "configs", "error_positions",
                                           "decode_prompts", "decode", "decode_chunk")}
    path = save(name, {"model": Path(a.model).name, "settings": settings, "results": results})
    print(f"wrote {path}")
    _plot(name, json.loads(path.read_text()))


def _plot(name: str, out: dict) -> None:
    results = out["results"]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, r in results.items():
        if "teacher_forced" not in r:
            continue
        tf, ae, dec = r["teacher_forced"], r["attention_error"], r["decoding"]
        axes[0].scatter(tf["working_set_share_of_history"], 100 * tf["top1_agreement"], label=label + " (prompt)")
        axes[0].scatter(dec["working_set_share_of_history"], 100 * dec["top1_agreement"], marker="^",
                        label=label + " (decoding)")
        axes[1].scatter(ae["working_set_share_of_history"], ae["mean_error"], label=label + " (mean)")
        axes[1].scatter(ae["working_set_share_of_history"], ae["worst_head_error"], marker="x",
                        label=label + " (worst head)")
    axes[0].axhline(98, color="grey", ls="--", lw=0.8, label="goal: 98 % top-1")
    axes[0].axvline(1 / 8, color="grey", ls=":", lw=0.8, label="1/8 of the history")
    axes[0].set_xlabel("working set / history (kept blocks over layer-steps)")
    axes[0].set_ylabel("top-1 agreement with full attention (%)")
    axes[1].set_xlabel("working set / history")
    axes[1].set_ylabel("relative attention-output error")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    st = out["settings"]
    fig.suptitle("\n".join(textwrap.wrap(
        f"retrieval as served — {out['model']}, {st['tokens']} tokens in {st['chunk']}-token prefill chunks, "
        f"window {st['window']}, from {st['min_tokens']} tokens on; decoding {st['decode']} tokens after "
        f"{st['decode_prompts']}; vllm-cpu on a {machine_words(out['machine'])}; commit {out['commit'][:7]}, one run",
        140)), fontsize=9)
    save_figure(fig, name)


if __name__ == "__main__":
    engine_or_main(engine_main, main)
