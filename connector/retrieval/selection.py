"""What a long request's layer attends to in one step: the history tokens its
own queries want most, chosen per query row."""

from __future__ import annotations

import math

import torch

from kvreel.connector.retrieval.history import LayerHistory
from kvreel.connector.retrieval.scoring import ROWS_AT_ONCE, Scratch, block_tokens, rows_of, scoring_dtype



def select_tokens(queries: torch.Tensor, keys: torch.Tensor, alpha: float, count: int, unit: int) -> torch.Tensor:
    """Per KV head, indices ``[H, m]`` into the ``n`` scored tokens (keys ``[H, n, D]``)
    to attend to, for query rows ``[H, R, D]``.

    Each row spreads its attention over the tokens (softmax of ``q . k / sqrt D``),
    and a token ranks by the largest share any one row gives it: the few rows
    of a prefill chunk that ask for a needle get it, whatever the chunk's other
    rows want (an average over the rows would drown them). Tokens are taken in
    that order until every row holds ``alpha`` of its mass (WiCSum, per row) or
    ``count``; ``m`` is a whole number of pages (``unit`` tokens), the same for
    every head (the kernel's pages per row)."""
    return select_in_groups(queries, keys, alpha, count, unit, queries.shape[1])[0]


def select_in_groups(queries: torch.Tensor, keys: torch.Tensor, alpha: float, count: int, unit: int,
                     group_rows: int, scratch: Scratch | None = None) -> list[torch.Tensor]:
    """``select_tokens`` for every run of ``group_rows`` query rows (a group of a
    prefill chunk's tokens), each with its own rows only: per group, indices
    ``[H, m_g]``. Rows are scored about ``ROWS_AT_ONCE`` at a time (so the scores
    stay in the CPU's cache): small groups several to a pass, each cut by WiCSum
    from the shares its pass holds (scored in ``scratch`` where given: a chunk
    takes dozens of passes); a larger group over several passes."""
    H, R, _ = queries.shape
    k = min(count, keys.shape[1])
    if k <= 0:
        return [torch.empty(H, 0, dtype=torch.int64, device=keys.device)] * -(-R // group_rows)
    dtype = scoring_dtype(keys.dtype, keys.device.type)
    q = queries.to(dtype) * queries.shape[-1] ** -0.5
    if R > ROWS_AT_ONCE and keys.shape[1] <= 2 * SCORE_BLOCK:    # passes over a few candidates: convert them once
        keys = keys.to(dtype).contiguous()
    if group_rows > ROWS_AT_ONCE:
        return [_select_over_passes(q[:, a:a + group_rows], keys, alpha, k, unit) for a in range(0, R, group_rows)]
    per_pass = ROWS_AT_ONCE // group_rows * group_rows
    chosen = []
    for a in range(0, R, per_pass):
        share = _log_shares(keys, q[:, a:a + per_pass], scratch)                          # [H, rows, n]
        for g in range(0, share.shape[1], group_rows):
            rows = share[:, g:g + group_rows]
            top = _top(rows.amax(1), k)                                                  # [H, k], best first
            if alpha < 1:
                need = _tokens_for_alpha(rows.gather(2, top.unsqueeze(1).expand(H, rows.shape[1], k)).exp_(), alpha)
                top = top[:, :_whole_pages(need, k, unit)]
            chosen.append(top)
    return chosen


def _log_shares(keys: torch.Tensor, q: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    """Each row's log softmax over the keys ``[H, r, n]`` (float32), made in
    ``scratch`` where given (in place: the same values as fresh tensors)."""
    if scratch is None:
        return torch.log_softmax(_scores(keys, q).float(), -1)
    shape = (q.shape[0], q.shape[1], keys.shape[1])
    logits = _scores(keys, q, scratch.take("logits", math.prod(shape), q.dtype).view(shape))
    if logits.dtype != torch.float32:
        logits = scratch.take("shares", logits.numel(), torch.float32).view(shape).copy_(logits)
    return torch.log_softmax(logits, -1, out=logits)


def _select_over_passes(q: torch.Tensor, keys: torch.Tensor, alpha: float, k: int, unit: int) -> torch.Tensor:
    """One group of more than ``ROWS_AT_ONCE`` rows (scaled ``q`` ``[H, R, D]``):
    the best share per token over passes, then the WiCSum cut from the chosen
    keys' scores (the passes' shares are gone)."""
    best, totals = None, []
    for at in range(0, q.shape[1], ROWS_AT_ONCE):
        logits = _scores(keys, q[:, at:at + ROWS_AT_ONCE]).float()
        share = torch.log_softmax(logits, -1)
        totals.append(logits[..., :1] - share[..., :1])                 # per row, log of the softmax's denominator
        best = share.amax(1) if best is None else torch.maximum(best, share.amax(1))
    top = _top(best, k)
    if alpha >= 1:
        return top
    chosen = rows_of(keys, top).to(q.dtype).transpose(1, 2)
    need = 0
    for at, total in zip(range(0, q.shape[1], ROWS_AT_ONCE), totals):
        taken = torch.bmm(q[:, at:at + ROWS_AT_ONCE], chosen).float().sub_(total).exp_()     # shares, best first
        need = max(need, _tokens_for_alpha(taken, alpha))
    return top[:, :_whole_pages(need, k, unit)]


def _whole_pages(need: int, k: int, unit: int) -> int:
    """``need`` tokens rounded up to whole pages of ``unit``, at least one, at most ``k``."""
    return min(k, max(unit, -(-need // unit) * unit))


def _tokens_for_alpha(taken: torch.Tensor, alpha: float) -> int:
    """How many of the tokens (shares ``[H, r, k]``, best first) every row needs to
    hold ``alpha`` of its mass (WiCSum)."""
    return int(((taken.cumsum(-1) - taken) < alpha - 1e-6).sum(-1).max())


SCORE_BLOCK = 4096           # keys converted at a time: small blocks reuse the allocator's memory


def _scores(keys: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q . k`` ``[H, r, n]`` for keys ``[H, n, D]`` and rows ``[H, r, D]`` (into
    ``out`` where given), rows by keys (each row's scores contiguous for the
    softmax), a product per head: keys are often a slice of the history's
    (heads a capacity apart), which a batched bf16 product first copies whole
    (8 K keys: 0.72 ms against 0.16 ms on an AVX512-BF16 core). Keys of another
    dtype than ``q``'s are converted a block at a time: one copy of every key at
    once is a fresh allocation each step, and its page faults cost more than
    the product (64 K keys: 27 ms against 9 ms)."""
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], keys.shape[1], dtype=q.dtype, device=q.device)
    if keys.dtype == q.dtype and keys.is_contiguous():      # e.g. a step's scored blocks' keys: one product
        return torch.bmm(q, keys.transpose(1, 2), out=out)
    if keys.dtype == q.dtype:
        for h in range(q.shape[0]):
            torch.mm(q[h], keys[h].transpose(0, 1), out=out[h])
        return out
    for a in range(0, keys.shape[1], SCORE_BLOCK):
        torch.bmm(q, keys[:, a:a + SCORE_BLOCK].to(q.dtype).transpose(1, 2), out=out[:, :, a:a + SCORE_BLOCK])
    return out


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries per row, largest first: an unsorted
    ``topk`` then a sort of those ``k`` (a sorted ``topk`` sorts every entry on CPU)."""
    values, index = torch.topk(score, k, dim=1, sorted=False)
    return index.gather(1, values.argsort(dim=1, descending=True))


def kept_tokens(share: float, budget_tokens: int, block_size: int, blocks: int) -> int:
    """History tokens a layer attends to beside the sink block, for a history of
    ``blocks`` blocks: ``share`` of it in whole pages, at most ``budget_tokens``'
    pages, at least one page."""
    pages = min(math.ceil(share * blocks), max(2, budget_tokens // block_size))
    return (max(2, pages) - 1) * block_size


def narrows(candidates: int, count: int, tokens: int) -> bool:
    """Whether ``tokens`` history tokens (the sink block aside) are narrowed to
    ``candidates x count`` before scoring: only where that at least halves them
    (narrowing less costs more than it saves)."""
    return 0 < 2 * candidates * count <= tokens


def choose_tokens(lh: LayerHistory, queries: torch.Tensor, alpha: float, count: int, candidates: int,
                  narrowing: str = "clusters") -> torch.Tensor:
    """The history tokens a layer's step attends to ``[H, bs + m]``: the sink block,
    then at most ``count`` tokens its queries ``[H, R, D]`` want most
    (``select_tokens``), scored among every history token, or, once the history
    is at least twice ``candidates x count``, among that many that ``narrowing``
    ranks best: the DRE's ``clusters`` (by centroid) or the blocks' key bounds
    (``pages``)."""
    return choose_tokens_in_groups(lh, queries, queries.shape[1], alpha, count, candidates, narrowing)[0]


def tally_scoring(tally: dict | None, history: int, scored: int, narrowing: str) -> None:
    """Add to ``tally`` a call's ``history`` tokens: ``scored`` by their keys, the
    rest passed over by ``narrowing`` ("clusters" or "bounds")."""
    if tally is not None:
        tally["keys"] = tally.get("keys", 0) + scored
        if history > scored:
            tally[narrowing] = tally.get(narrowing, 0) + history - scored


def choose_tokens_in_groups(lh: LayerHistory, queries: torch.Tensor, group_rows: int, alpha: float, count: int,
                            candidates: int, narrowing: str = "clusters", scratch: Scratch | None = None,
                            tally: dict | None = None) -> list[torch.Tensor]:
    """``choose_tokens`` for every run of ``group_rows`` query rows, each group
    selecting with its own rows only (``select_in_groups``, its passes scored
    in ``scratch`` where given; ``tally_scoring`` into ``tally``).
    Narrowing ranks by the largest share any row of the chunk gives (so a row
    looking for a needle brings its cluster or block in, whatever the others want)."""
    bs = lh.block_size
    history = lh.num_tokens - bs
    if narrows(candidates, count, history):
        if narrowing == "pages":
            blocks = lh.best_blocks(queries, -(-candidates * count // bs))
            scored = block_tokens(blocks, bs)
            keys = lh.block_keys(blocks)
        else:
            scored = lh.candidates(queries, candidates * count, scratch)
            keys = rows_of(lh.keys, scored)
        tally_scoring(tally, history, scored.shape[1], "bounds" if narrowing == "pages" else "clusters")
        chosen = [scored.gather(1, c) for c in select_in_groups(queries, keys, alpha, count, bs, group_rows,
                                                                scratch)]
    else:
        tally_scoring(tally, history, history, "clusters")
        chosen = [c + bs for c in select_in_groups(queries, lh.keys[:, bs:lh.num_tokens], alpha, count, bs,
                                                   group_rows, scratch)]
    sink = torch.arange(bs).expand(lh.heads, -1)
    return [torch.cat([sink, c], 1) for c in chosen]


def choose_blocks(lh: LayerHistory, queries: torch.Tensor, alpha: float, count: int, candidates: int,
                  scratch: Scratch | None = None, tally: dict | None = None) -> torch.Tensor:
    """The history blocks a decoding step's few query rows ``[H, R, D]`` attend to
    ``[H, 1 + m]``: the sink block, then at most ``count`` tokens' worth of whole
    blocks, best first. The blocks the rows rank best by their keys' bounds
    (``candidates`` x ``count`` tokens of them, where that at least halves the
    history) are scored exactly, token by token; a block ranks by the largest
    share of its row's attention it holds for any row, and blocks are taken in
    that order until every row holds ``alpha`` of its mass (WiCSum) or ``count``.
    Whole blocks are what makes a decoding step cheap: the history keeps them as
    vLLM packed them, so holding them is a page copy, and ranking a few dozen
    blocks replaces sorting thousands of tokens. The scored keys are copied into
    ``scratch`` where given (``LayerHistory.block_keys``); ``tally_scoring`` into ``tally``."""
    bs, H = lh.block_size, lh.heads
    held = lh.num_tokens // bs
    if narrows(candidates, count, lh.num_tokens - bs):
        scored = lh.best_blocks(queries, -(-candidates * count // bs))
    else:
        scored = torch.arange(1, held).expand(H, -1)
    n = scored.shape[1]
    tally_scoring(tally, lh.num_tokens - bs, n * bs, "bounds")
    q = queries.to(lh.keys.dtype) * queries.shape[-1] ** -0.5
    share = torch.softmax(_scores(lh.block_keys(scored, scratch), q).float(), -1)       # [H, R, n bs]
    mass = share.view(H, q.shape[1], n, bs).sum(-1)                                      # [H, R, n]
    order = mass.amax(1).argsort(dim=1, descending=True)
    keep = min(n, max(1, count // bs))
    if alpha < 1:
        keep = min(keep, max(1, _tokens_for_alpha(mass.gather(2, order.unsqueeze(1).expand_as(mass)), alpha)))
    sink = torch.zeros(H, 1, dtype=scored.dtype)
    return torch.cat([sink, scored.gather(1, order[:, :keep])], 1)
