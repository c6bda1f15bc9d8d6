"""What a long request's layer attends to in one step: the history tokens its
own queries want most, chosen per query row."""

from __future__ import annotations

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
    keys_t = keys.transpose(1, 2)
    q = queries.to(keys.dtype) * queries.shape[-1] ** -0.5
    best = torch.zeros(H, keys.shape[1], device=keys.device)
    totals = []
    for at in range(0, R, ROWS_AT_ONCE):           # a few rows at a time: the scores stay in the CPU's cache
        logits = torch.bmm(q[:, at:at + ROWS_AT_ONCE], keys_t).float()
        top_logit = logits.amax(-1, keepdim=True)
        share = logits.sub_(top_logit).exp_()
        total = share.sum(-1, keepdim=True)
        best = torch.maximum(best, share.div_(total).amax(1))
        totals.append(top_logit + total.log())
    top = torch.topk(best, k, dim=1).indices                                 # [H, k], best first
    if alpha < 1:
        chosen = rows_of(keys, top).transpose(1, 2)
        need = 0
        for at, total in zip(range(0, R, ROWS_AT_ONCE), totals):
            taken = torch.bmm(q[:, at:at + ROWS_AT_ONCE], chosen).float().sub_(total).exp_()   # shares, best first
            need = max(need, int(((taken.cumsum(-1) - taken) < alpha - 1e-6).sum(-1).max()))
        k = min(k, max(unit, -(-need // unit) * unit))
    return top[:, :k]


def narrows(candidates: int, count: int, tokens: int) -> bool:
    """Whether the DRE's clusters narrow ``tokens`` history tokens (the sink block
    aside) to ``candidates x count`` before scoring: only where that at least
    halves them (narrowing less costs more than it saves)."""
    return 0 < 2 * candidates * count <= tokens


def choose_tokens(lh: LayerHistory, queries: torch.Tensor, alpha: float, count: int, candidates: int) -> torch.Tensor:
    """The history tokens a layer's step attends to ``[H, bs + m]``: the sink block,
    then at most ``count`` tokens its queries ``[H, R, D]`` want most
    (``select_tokens``), scored among every history token, or among the
    ``candidates x count`` the DRE's clusters rank best once the history is at
    least twice that long."""
    bs = lh.block_size
    if narrows(candidates, count, lh.num_tokens - bs):
        scored = lh.candidates(queries, candidates * count)
        chosen = scored.gather(1, select_tokens(queries, rows_of(lh.keys, scored), alpha, count, bs))
    else:
        chosen = select_tokens(queries, lh.keys[:, bs:lh.num_tokens], alpha, count, bs) + bs
    return torch.cat([torch.arange(bs).expand(lh.heads, -1), chosen], 1)
