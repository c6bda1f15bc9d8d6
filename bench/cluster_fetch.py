"""Host -> working-set fetch, as served, in one run: kvreel's history layout
(KVMU: per layer and KV head, page slabs in cluster order, so a selection moves
as whole slabs, consecutive ones in one copy, already packed as vLLM's kernel
reads them) vs a per-token layout (K and V token-major: the selected tokens
gathered one by one, then packed into pages with vLLM's own op), building the
same working set from the same selection.

    python bench/cluster_fetch.py --model ../shared/models/tinycode-16m-4k --tokens 8192

Keys, values and queries are a trained model's (one forward pass over Python
source); every layer's selection is the serving one (the DRE's clusters and
predicted mass, ``select_slabs`` at ``--alpha`` and the budgets below), so the
sizes are the served ones. Times are per layer, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import in_process_dre, plot_lines, save  # noqa: E402
from kv_capture import capture_qkv  # noqa: E402

BUDGETS = (512, 1024, 2048, 4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--method", default="resv")
    ap.add_argument("--alpha", type=float, default=0.99)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4, help="layers measured (the first ones)")
    a = ap.parse_args()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvreel.connector.retrieval.history import LayerHistory
    from kvreel.connector.retrieval.page_packing import PagePacking
    from kvreel.connector.retrieval.runtime import select_slabs
    bs = 32
    q_all, k_all, v_all = capture_qkv(a.model, a.tokens)
    L, Hq, T, D = q_all.shape
    H = k_all.shape[1]
    G = Hq // H
    packing = PagePacking(bs, D, torch.bfloat16, _get_attn_isa(torch.bfloat16, bs, D, "auto"))
    call = in_process_dre()

    rows = []
    n_blocks = T // bs
    for layer in range(min(a.layers, L)):
        k = k_all[layer].transpose(0, 1).bfloat16()                 # [T, H, D]
        v = v_all[layer].transpose(0, 1).bfloat16()
        pages = torch.zeros(n_blocks, H, 2 * bs, D, dtype=torch.bfloat16)
        packing.pack(k[:n_blocks * bs], v[:n_blocks * bs], pages, torch.arange(n_blocks * bs))
        lh = LayerHistory(H, bs, D, torch.bfloat16, packing)
        keys = lh.append(pages, 0)
        lh.set_labels(bs, call("cluster", handle="h", keys=keys, method=a.method)["labels"])
        lh.compact()
        mass = call("mass", handle="h", queries=q_all[layer, :, -1].view(H, G, D), alpha=a.alpha)["mass"]
        for budget in BUDGETS:
            slabs = select_slabs(lh.slab_mass(mass), a.alpha, budget // bs - 1)
            m = slabs.shape[1]
            tokens = lh.tokens[torch.arange(H).unsqueeze(1), slabs].reshape(H, m * bs)    # what each head keeps
            runs = sum(int(((s[1:] - s[:-1]) != 1).sum()) + 1 for s in torch.sort(slabs, dim=1).values)
            ws = torch.empty(m + 1, H, 2 * bs, D, dtype=torch.bfloat16)

            def slab_copy():
                for h in range(H):
                    ws[1:, h] = lh.slabs[h].index_select(0, slabs[h])

            def per_token():
                kk = torch.empty(m * bs, H, D, dtype=torch.bfloat16)
                vv = torch.empty(m * bs, H, D, dtype=torch.bfloat16)
                for h in range(H):
                    kk[:, h] = k[:, h].index_select(0, tokens[h])
                    vv[:, h] = v[:, h].index_select(0, tokens[h])
                packing.pack(kk, vv, ws, torch.arange(bs, (m + 1) * bs))

            per_token()
            want = ws.clone()
            slab_copy()
            assert torch.equal(ws[1:].view(torch.int16), want[1:].view(torch.int16))   # the same working set
            t_slab, t_token = _median(slab_copy, a.repeats), _median(per_token, a.repeats)
            nbytes = m * H * 2 * bs * D * 2
            rows.append({"layer": layer, "budget_tokens": budget, "kept_share": (m + 1) / n_blocks,
                         "copies_slab_runs": runs, "bytes": nbytes,
                         "slab_ms": 1e3 * t_slab, "per_token_ms": 1e3 * t_token,
                         "slab_gbps": nbytes / t_slab / 1e9, "per_token_gbps": nbytes / t_token / 1e9,
                         "speedup": t_token / t_slab})
            print(rows[-1], flush=True)
        call("drop", handle="h")
    by_budget = {b: [r for r in rows if r["budget_tokens"] == b] for b in BUDGETS}
    summary = {b: {"kept_share": statistics.mean(r["kept_share"] for r in rs),
                   "speedup": statistics.median(r["speedup"] for r in rs),
                   "slab_gbps": statistics.median(r["slab_gbps"] for r in rs),
                   "per_token_gbps": statistics.median(r["per_token_gbps"] for r in rs)} for b, rs in by_budget.items()}
    save("cluster_fetch", {"model": Path(a.model).name,
                           "settings": {k: getattr(a, k) for k in ("tokens", "method", "alpha", "repeats", "layers")},
                           "summary": summary, "rows": rows})
    plot_lines("cluster_fetch", [summary[b]["kept_share"] for b in BUDGETS],
               {"slab copy (cluster-ordered history)": [summary[b]["slab_gbps"] for b in BUDGETS],
                "per-token gather + pack": [summary[b]["per_token_gbps"] for b in BUDGETS]},
               "working set / history", "GB/s into the working set",
               f"{Path(a.model).name}, {a.method}, {a.tokens} tokens, per layer (median)")


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    main()
