"""How many prefill rows may share one working set, and what alpha and the
budget buy: teacher-forced top-1 agreement with full attention when a prefill
chunk's rows are selected for in groups of G (``KVREEL_RETRIEVAL_ROWS_PER_SET``)
at each alpha and budget share given, offline, in transformers.

The model runs its eager attention with each position past the retrieval
threshold restricted to what kvreel would let it see: the sink block, the
history tokens its group's queries select (kvreel's own ``select_tokens``, at
kvreel's defaults unless ``--alphas`` / ``--shares`` say otherwise), then the
window and the chunk up to itself. Full attention in the same run is the
reference. Every history token is scored exactly (as kvreel does below twice
the candidates x the budget; past that its clusters narrow the scoring first).

    python bench/prefill_groups.py --model /path/to/smollm2-135m --groups 512,64,16
    python bench/prefill_groups.py --model ... --groups 64 --alphas 0.9,0.99,1 --name prefill_alpha
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import plot_agreement, python_source_corpus, save  # noqa: E402

from kvreel.connector.config import KVReelConfig  # noqa: E402
from kvreel.connector.retrieval.selection import kept_tokens, select_tokens  # noqa: E402

MEASURES = ("connector/retrieval", "dre")  # the package paths its figures measure (bench/report.py)

BLOCK = 32


class RetrievalMask:
    """Eager attention over what a group of prefill rows would attend to under kvreel."""

    def __init__(self, original, cfg: KVReelConfig, tokens: int, chunk: int):
        self.original, self.cfg, self.tokens, self.chunk = original, cfg, tokens, chunk
        self.group: int | None = None          # None: full attention
        self.alpha, self.share = cfg.retrieval_alpha, cfg.retrieval_budget_share
        self.read = [0, 0]                     # history tokens attended to / history tokens, summed

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if self.group is None:
            return self.original(module, query, key, value, attention_mask, scaling, dropout, **kw)
        from transformers.models.llama.modeling_llama import repeat_kv
        q, k = query[0], key[0]                                   # [Hq, T, D], [H, T, D]
        heads, per_head = k.shape[0], q.shape[0] // k.shape[0]
        keys, values = repeat_kv(key, per_head)[0], repeat_kv(value, per_head)[0]
        out = torch.empty_like(q)
        for s in range(0, self.tokens, self.chunk):
            e = min(s + self.chunk, self.tokens)
            logits = torch.matmul(q[:, s:e], keys[:, :e].transpose(1, 2)).float() * scaling
            allowed = torch.ones(q.shape[0], e - s, e, dtype=torch.bool).tril(s)
            if s >= self.cfg.retrieval_min_tokens:
                history = (s - self.cfg.retrieval_window) // BLOCK * BLOCK
                count = kept_tokens(self.share, self.cfg.retrieval_budget_tokens, BLOCK, history // BLOCK)
                for a in range(s, e, self.group):
                    b = min(a + self.group, e)
                    rows = q[:, a:b].reshape(heads, per_head * (b - a), -1)
                    chosen = select_tokens(rows, k[:, BLOCK:history], self.alpha, count, BLOCK) + BLOCK
                    self.read[0] += chosen.shape[1] * heads
                    self.read[1] += (history - BLOCK) * heads
                    seen = torch.zeros(heads, e, dtype=torch.bool)
                    seen[:, :BLOCK] = True
                    seen.scatter_(1, chosen, True)
                    seen[:, history:] = True
                    allowed[:, a - s:b - s] &= seen.repeat_interleave(per_head, 0)[:, None, :]
            logits.masked_fill_(~allowed, -math.inf)
            out[:, s:e] = torch.matmul(torch.softmax(logits, -1).to(q.dtype), values[:, :e])
        return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Llama-architecture model directory (transformers)")
    ap.add_argument("--groups", default="512,64,16", help="rows per working set, comma separated")
    ap.add_argument("--tokens", type=int, default=6144, help="held-out Python source, prefilled in chunks")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--alphas", default=None, help="KVREEL_RETRIEVAL_ALPHA values (default: kvreel's)")
    ap.add_argument("--shares", default=None, help="KVREEL_RETRIEVAL_BUDGET_SHARE values (default: kvreel's)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the model's dtype (vLLM serves bf16; on a CPU without AVX-512 bf16 runs far slower)")
    ap.add_argument("--name", default="prefill_groups")
    a = ap.parse_args()
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cfg = KVReelConfig.load(env={"KVREEL_RETRIEVAL": "resv"})
    ids = AutoTokenizer.from_pretrained(a.model)(python_source_corpus(8 * a.tokens))["input_ids"][:a.tokens]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype),
                                                 attn_implementation="eager").eval()
    mask = RetrievalMask(llama.eager_attention_forward, cfg, a.tokens, a.chunk)
    llama.eager_attention_forward = mask
    x = torch.tensor([ids])
    scored = slice(cfg.retrieval_min_tokens - 1, a.tokens - 1)     # predictions of positions past the threshold
    rows = []
    with torch.no_grad():
        t0 = time.perf_counter()
        reference = model(x).logits[0].argmax(-1)
        print(f"full attention: {time.perf_counter() - t0:.0f} s", flush=True)
        for group, alpha, share in itertools.product(
                [int(g) for g in a.groups.split(",")],
                [float(v) for v in a.alphas.split(",")] if a.alphas else [cfg.retrieval_alpha],
                [float(v) for v in a.shares.split(",")] if a.shares else [cfg.retrieval_budget_share]):
            mask.group, mask.alpha, mask.share, mask.read = group, alpha, share, [0, 0]
            t0 = time.perf_counter()
            got = model(x).logits[0].argmax(-1)
            agreement = (got[scored] == reference[scored]).float().mean().item()
            rows.append({"rows_per_set": group, "alpha": alpha, "budget_share": share, "top1_agreement": agreement,
                         "history_read": mask.read[0] / mask.read[1], "seconds": time.perf_counter() - t0})
            print(rows[-1], flush=True)
    settings = {"tokens": a.tokens, "chunk": a.chunk, "dtype": a.dtype,
                "positions_scored": a.tokens - cfg.retrieval_min_tokens,
                **{k: getattr(cfg, k) for k in ("retrieval_budget_tokens", "retrieval_window", "retrieval_min_tokens")},
                "scoring": "every history token (no cluster narrowing)", "reference": "full attention, same run"}
    import transformers
    name = f"{a.name}_{Path(a.model).name}"
    path = save(name, {"model": Path(a.model).name, "transformers": transformers.__version__,
                       "settings": settings, "rows": rows})
    print(f"wrote {path}")
    plot(name, Path(a.model).name, rows, settings)


def plot(name: str, model: str, rows: list[dict], settings: dict) -> None:
    """Agreement against the share of the history read, one labelled point per setting."""
    plot_agreement(name, [(100 * r["history_read"], 100 * r["top1_agreement"],
                           f"G={r['rows_per_set']}, a={r['alpha']:g}, 1/{1 / r['budget_share']:g}") for r in rows],
                   "history read (% of the history tokens, every layer and head)",
                   f"{model}: {settings['tokens']} tokens of Python in {settings['chunk']}-token chunks; G rows per\n"
                   f"working set, alpha a, budget share; offline (transformers, {settings.get('dtype', 'bfloat16')}), "
                   "2-core x86 CPU, one run")

if __name__ == "__main__":
    main()
