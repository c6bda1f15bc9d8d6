"""What choosing a working set costs a step, per layer, against the history's length.

    python bench/selection_latency.py [--tokens 2048,...,65536] [--method resv|mosaic]

One layer of a long request, shaped like tinycode-16m (2 KV heads, 3 query
heads each, head_dim 64) with vLLM's default CPU block size (128), its keys
drawn around 64 centres per head (synthetic: the cost depends on how many
tokens and clusters there are, not on what they say). The history goes
through the served path: ``RetrievalRuntime.add_history`` (pages unpacked,
keys sent to a DRE process the runtime starts itself, labels back), then
``RetrievalRuntime.working_set`` at the default budget (1/8 of the history, at
most 4 096 tokens), timed for a decode step (one query token), and
``RetrievalRuntime.choose_in_groups`` for a 512-token prefill chunk in the
default's groups (``KVREEL_RETRIEVAL_ROWS_PER_SET`` tokens each, several groups
to a scoring pass), and apart from it (``served chunk write``) the writing of
the groups' chosen tokens into pages as ``_attend_in_groups`` does.
``--kv-heads 3``: SmolLM2-135M's shape (3 KV heads of 3 query heads each).
Every figure is the median of ``--repeat`` steps, measured in ``--rounds``
rounds; the JSON holds each round and their median. Per history length:

* ``served``: the defaults: a decode step scores exactly the tokens of the
  blocks its queries rank best by their keys' bounds
  (``KVREEL_RETRIEVAL_DECODE_CANDIDATES``, 2x the budget); a chunk, from twice
  ``KVREEL_RETRIEVAL_CANDIDATES`` (8) x the budget on, the tokens of the DRE's
  best clusters;
* ``decode as chunks``: ``KVREEL_RETRIEVAL_DECODE_CANDIDATES=0`` (the defaults
  before decode steps had their own narrowing);
* ``every token``: ``KVREEL_RETRIEVAL_CANDIDATES=0``, ``DECODE_CANDIDATES=0``,
  every history token scored;
* ``pages xN``: ``KVREEL_RETRIEVAL_NARROWING=pages`` with ``N`` candidates
  (``--page-candidates``, 2), ``DECODE_CANDIDATES=0``: blocks ranked by their
  keys' bounds for chunks too, no DRE;
* baseline in the same run: full attention of the same queries over the whole
  history (float32 SDPA), what a layer without retrieval computes;
* ``extend``: the DRE labelling one new block, off the critical path (its
  latency only says how soon new tokens get a cluster), from after the block
  was appended; ``history_append_ms``, the append itself, here includes the
  history's one-off growth of its room (the whole history was added with none
  to spare; a served prefill reserves its prompt's room at once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import plot_lines, save  # noqa: E402
from kvreel.connector.retrieval.selection import narrows  # noqa: E402
from kvreel.connector.retrieval.working_set import write_history_pages  # noqa: E402

MEASURES = ("connector/retrieval", "dre")  # the package paths its figures measure (bench/report.py)

H, G, D, BLOCK, CHUNK = 2, 3, 64, 128, 512


def pages_for(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic clustered keys and values [T, H, D] (bf16)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(H, 64, D, generator=g) * 2
    pick = torch.randint(0, 64, (H, T), generator=g)
    k = torch.gather(centres, 1, pick.unsqueeze(-1).expand(H, T, D)) + 0.5 * torch.randn(H, T, D, generator=g)
    return k.transpose(0, 1).bfloat16(), torch.randn(T, H, D, generator=g).bfloat16()


def runtime_for(method: str, candidates: int | None, narrowing: str | None = None, decode: int | None = None):
    """A retrieval runtime for one layer; ``candidates``, ``narrowing``, ``decode`` None: the defaults."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.retrieval.runtime import RetrievalRuntime
    env = {"KVREEL_RETRIEVAL": method}
    if candidates is not None:
        env["KVREEL_RETRIEVAL_CANDIDATES"] = str(candidates)
    if narrowing is not None:
        env["KVREEL_RETRIEVAL_NARROWING"] = narrowing
    if decode is not None:
        env["KVREEL_RETRIEVAL_DECODE_CANDIDATES"] = str(decode)
    cfg = KVReelConfig.load(env=env)
    rt = RetrievalRuntime(cfg)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    rt.register_caches({"model.layers.0.self_attn.attn": torch.zeros(1, H, BLOCK, 2 * D, dtype=torch.bfloat16)},
                       spec, max_batched_tokens=CHUNK)
    return rt


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def rounds(row: dict, key: str, fn, a) -> None:
    """``row[key]``: the median over ``a.rounds`` rounds of ``timed(fn)``, each round beside it."""
    each = [timed(fn, a.repeat) for _ in range(a.rounds)]
    row[key] = statistics.median(each)
    row[key + " each round"] = each


def main() -> None:
    global H
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,4096,8192,16384,32768,65536")
    ap.add_argument("--method", default="resv", choices=("resv", "mosaic"))
    ap.add_argument("--kv-heads", type=int, default=H, help="KV heads of the layer (3: SmolLM2-135M's shape)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--page-candidates", type=int, default=2,
                    help="KVREEL_RETRIEVAL_CANDIDATES of the KVREEL_RETRIEVAL_NARROWING=pages runtime")
    a = ap.parse_args()
    H = a.kv_heads                      # the layer's shape, read by pages_for and runtime_for
    rows = []
    runtimes = {"served": runtime_for(a.method, None), "decode as chunks": runtime_for(a.method, None, decode=0),
                "every token": runtime_for(a.method, 0, decode=0),
                f"pages x{a.page_candidates}": runtime_for(a.method, a.page_candidates, "pages", decode=0)}
    for T in tqdm([int(t) for t in a.tokens.split(",")], desc="history lengths"):
        k, v = pages_for(T)
        packing = runtimes["served"].packing
        pages = torch.zeros(T // BLOCK, H, 2 * BLOCK, D, dtype=torch.bfloat16)
        packing.pack(k, v, pages, torch.arange(T))
        g = torch.Generator().manual_seed(T)
        q_chunk = torch.randn(H, CHUNK * G, D, generator=g)
        q_decode = q_chunk[:, :G]
        row = {"history_tokens": T}
        for name, rt in runtimes.items():
            req = f"T{T}"
            rt.add_history(req, 0, [pages[:-1]])
            hist = rt.histories[req]
            lh = hist.layers[0]
            clustered = rt.clusters_for(hist)
            t0 = time.perf_counter()
            while clustered and bool((lh.labels < 0).any()):       # the DRE's labels for the whole history
                time.sleep(0.005)
                rt.dre.take_labels(rt.histories)
            if clustered and name == "served":
                row["dre_cluster_ms"] = (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            rt.add_history(req, T // BLOCK - 1, [pages[-1:]])
            t1 = time.perf_counter()
            while clustered and bool((lh.labels < 0).any()):
                time.sleep(0.001)
                rt.dre.take_labels(rt.histories)
            if clustered and name == "served":
                row["history_append_ms"] = (t1 - t0) * 1000
                row["dre_extend_ms"] = (time.perf_counter() - t1) * 1000
            row[f"{name}: narrowed"] = narrows(rt.cfg.retrieval_candidates, rt.kept_tokens(hist.num_blocks),
                                                           lh.num_tokens - BLOCK)      # the rule choose_tokens applies
            per_set = rt.cfg.retrieval_rows_per_set * G
            for step, fn in (("decode", lambda: rt.working_set(req, 0, q_decode)),
                             ("chunk", lambda: rt.choose_in_groups(req, 0, q_chunk, per_set))):
                rounds(row, f"{name} {step} ms", fn, a)
            if name == "served":
                tokens = torch.cat(rt.choose_in_groups(req, 0, q_chunk, per_set), 1)
                written = torch.empty(tokens.shape[1] // BLOCK, H, 2 * BLOCK, D, dtype=torch.bfloat16)
                rounds(row, "served chunk write ms", lambda: write_history_pages(written, lh, tokens), a)
            row["kept_tokens"] = rt.working[req, 0].m * BLOCK
            rt.drop(req)
        keys = k.transpose(0, 1).float().unsqueeze(0)
        values = v.transpose(0, 1).float().unsqueeze(0)
        for step, q in (("decode", q_decode), ("chunk", q_chunk)):
            queries = q.reshape(H * G, -1, D).unsqueeze(0) if step == "decode" else \
                q.view(H, CHUNK, G, D).permute(0, 2, 1, 3).reshape(1, H * G, CHUNK, D)
            rounds(row, f"full attention {step} ms", lambda: torch.nn.functional.scaled_dot_product_attention(
                queries, keys, values, enable_gqa=True), a)
        rows.append(row)
        print(row, flush=True)
    name = "selection_latency" + ("_mosaic" if a.method == "mosaic" else "") + (f"_{H}kv" if H != 2 else "")
    settings = {"method": a.method, "kv_heads": H, "query_heads_per_kv": G, "head_dim": D, "block_size": BLOCK,
                "prefill_chunk_tokens": CHUNK, "repeat": a.repeat, "rounds": a.rounds, "budget": "defaults: 1/8 of the history, at most 4096 tokens",
                "dre": "a process started by the runtime (one torch thread, nice 10), as served"}
    path = save(name, {"settings": settings, "rows": rows, "packing_isa": packing.isa})
    x = [r["history_tokens"] for r in rows]
    series = {f"{n} {s}": [r[f"{n} {s} ms"] for r in rows]
              for s in ("decode", "chunk") for n in (*runtimes, "full attention")}
    series["served chunk write"] = [r["served chunk write ms"] for r in rows]
    plot_lines(name, x, series, "history tokens", "ms per layer-step (median)",
               f"working-set choice per layer-step vs full attention ({a.method}; {H} KV heads, block 128, "
               f"2-core x86 CPU; each point the median of {a.rounds} rounds of {a.repeat} steps)", logy=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
