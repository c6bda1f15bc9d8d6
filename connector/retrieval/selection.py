"""What a long request's layer attends to in one step: the history tokens its
own queries want most, chosen per query row."""

from __future__ import annotations

import math

import torch

from kvreel.connector.retrieval.history import LayerHistory, rows_of

ROWS_AT_ONCE = 32            # query rows scored together


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
    H, R, _ = queries.shape
    k = min(count, keys.shape[1])
    if k <= 0:
        return torch.empty(H, 0, dtype=torch.int64, device=keys.device)
    q = queries.to(keys.dtype) * queries.shape[-1] ** -0.5
    best = None
    totals = []
    for at in range(0, R, ROWS_AT_ONCE):           # a few rows at a time: the scores stay in the CPU's cache
        logits = _scores(keys, q[:, at:at + ROWS_AT_ONCE]).float()
        top_logit = logits.amax(-1, keepdim=True)
        share = logits.sub_(top_logit).exp_()
        total = share.sum(-1, keepdim=True)
        rows_best = share.div_(total).amax(1)
        best = rows_best if best is None else torch.maximum(best, rows_best)
        totals.append(top_logit + total.log())
    top = _top(best, k)                                                      # [H, k], best first
    if alpha < 1:
        if R <= ROWS_AT_ONCE:                      # one pass held every row's shares (decoding): read them
            need = _tokens_for_alpha(share.gather(2, top.unsqueeze(1).expand(H, R, k)), alpha)
        else:
            chosen = rows_of(keys, top).transpose(1, 2)
            need = 0
            for at, total in zip(range(0, R, ROWS_AT_ONCE), totals):
                taken = torch.bmm(q[:, at:at + ROWS_AT_ONCE], chosen).float().sub_(total).exp_()  # shares, best first
                need = max(need, _tokens_for_alpha(taken, alpha))
        k = min(k, max(unit, -(-need // unit) * unit))
    return top[:, :k]


def _tokens_for_alpha(taken: torch.Tensor, alpha: float) -> int:
    """How many of the tokens (shares ``[H, r, k]``, best first) every row needs to
    hold ``alpha`` of its mass (WiCSum)."""
    return int(((taken.cumsum(-1) - taken) < alpha - 1e-6).sum(-1).max())


def _scores(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q . k`` ``[H, r, n]`` for keys ``[H, n, D]`` and rows ``[H, r, D]``, one
    matrix product per head: the history's keys are a slice of a larger buffer,
    and ``bmm`` over such a slice copies every key first (2x slower for 64 K
    keys on this CPU). A few rows (decoding) multiply ``q . k^T``; many (a
    prefill chunk's), ``k . q^T`` (the faster order for each here)."""
    if q.shape[1] <= 8:
        return torch.stack([torch.mm(q[h], keys[h].T) for h in range(keys.shape[0])])
    return torch.stack([torch.mm(keys[h], q[h].T) for h in range(keys.shape[0])]).transpose(1, 2)


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
    bs = lh.block_size
    if narrows(candidates, count, lh.num_tokens - bs):
        scored = lh.page_candidates(queries, candidates * count) if narrowing == "pages" else \
            lh.candidates(queries, candidates * count)
        chosen = scored.gather(1, select_tokens(queries, rows_of(lh.keys, scored), alpha, count, bs))
    else:
        chosen = select_tokens(queries, lh.keys[:, bs:lh.num_tokens], alpha, count, bs) + bs
    return torch.cat([torch.arange(bs).expand(lh.heads, -1), chosen], 1)
