"""The pieces of history offload, outside an engine: vLLM's page packing
learned from its own op, the per-head token history and its DRE
clusters, per-query token selection, and the KV cache manager that frees what kvreel holds."""

from __future__ import annotations

import pytest
import torch

BS, H, D = 32, 2, 64


def isa():
    from kvreel.connector.vllm_internals import cpu_attn_isa
    return cpu_attn_isa(torch.bfloat16, BS, D)


def packing():
    from kvreel.connector.retrieval.page_packing import PagePacking
    return PagePacking(BS, D, torch.bfloat16, isa())


def pages_of(k, v):
    """Tokens [n * bs, H, D] as cache pages [n, H, 2 bs, D], written by vLLM's op."""
    n = k.shape[0] // BS
    cache = torch.zeros(n, H, 2 * BS, D, dtype=torch.bfloat16)
    packing().pack(k, v, cache, torch.arange(n * BS))
    return cache


@pytest.mark.parametrize("head_dim,block", [(64, 32), (128, 32), (64, 16)])
def test_unpacking_inverts_vllms_packing_byte_exactly(head_dim, block):
    from kvreel.connector.retrieval.page_packing import PagePacking
    from kvreel.connector.vllm_internals import cpu_attn_isa
    pp = PagePacking(block, head_dim, torch.bfloat16, cpu_attn_isa(torch.bfloat16, block, head_dim))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3 * block, 3, head_dim, generator=g).bfloat16()
    v = torch.randn(3 * block, 3, head_dim, generator=g).bfloat16()
    cache = torch.zeros(5, 3, 2 * block, head_dim, dtype=torch.bfloat16)
    pp.pack(k, v, cache, torch.arange(3 * block) + block)
    k2, v2 = pp.unpack(cache[1:4])
    assert torch.equal(k2.view(torch.int16), k.view(torch.int16))
    assert torch.equal(v2.view(torch.int16), v.view(torch.int16))


def history(blocks=12, seed=0):
    from kvreel.connector.retrieval.history import LayerHistory
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * BS, H, D, generator=g).bfloat16()
    v = torch.randn(blocks * BS, H, D, generator=g).bfloat16()
    lh = LayerHistory(H, BS, D, torch.bfloat16, packing())
    return lh, k, v


def test_history_holds_every_token_in_order_and_hands_the_keys_after_the_sink_to_the_dre():
    from kvreel.connector.retrieval.scoring import scoring_dtype
    lh, k, v = history()
    pages = pages_of(k, v)
    keys = lh.append(pages[:5], 0)
    more = lh.append(pages[5:], 5)
    assert lh.num_tokens == 12 * BS
    assert torch.equal(torch.cat([keys, more], 1), k[BS:].transpose(0, 1).float())
    assert torch.equal(lh.dre_keys(), k[BS:].transpose(0, 1).float())
    assert lh.keys.dtype == scoring_dtype(torch.bfloat16)         # float32 on a CPU without bf16 products
    held = lh.keys[:, :lh.num_tokens].to(torch.bfloat16)          # exact: bf16 -> float32 -> bf16 is lossless
    assert torch.equal(held.view(torch.int16), k.transpose(0, 1).view(torch.int16))
    assert torch.equal(lh.pages[:12].view(torch.int16), pages.view(torch.int16))     # vLLM's pages, as packed
    with pytest.raises(ValueError, match="history holds 384 tokens, got blocks from 3"):
        lh.append(pages[:1], 3)


@pytest.mark.parametrize("values_in_rows", [True, False], ids=["values-from-pages", "values-apart"])
def test_a_histories_tokens_come_back_byte_exactly_whatever_the_packing_keeps_in_rows(values_in_rows):
    """Where vLLM's packing interleaves a token's values (AMX), the history keeps them
    in token order too, and charges the host budget for them; on any CPU kind
    both ways read back the bytes vLLM packed."""
    from kvreel.connector.retrieval.history import LayerHistory, history_bytes_per_block
    pp = packing()
    pp.values_in_rows = values_in_rows and pp.values_in_rows
    lh = LayerHistory(H, BS, D, torch.bfloat16, pp)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(6 * BS, H, D, generator=g).bfloat16()
    v = torch.randn(6 * BS, H, D, generator=g).bfloat16()
    pages = pages_of(k, v)
    lh.append(pages[:2], 0)
    lh.append(pages[2:], 2)                               # its room grows: what it held is kept
    assert (lh.values is None) == pp.values_in_rows
    tokens = torch.stack([torch.randperm(6 * BS, generator=g)[:70] for _ in range(H)])
    got_k, got_v = lh.token_rows(tokens)
    for h in range(H):
        assert torch.equal(got_k[:, h].view(torch.int16), k[tokens[h], h].view(torch.int16))
        assert torch.equal(got_v[:, h].view(torch.int16), v[tokens[h], h].view(torch.int16))
    in_rows, apart = packing(), packing()
    in_rows.values_in_rows, apart.values_in_rows = True, False
    page_bytes = pages[0].numel() * pages.element_size()
    assert history_bytes_per_block(page_bytes, apart) - history_bytes_per_block(page_bytes, in_rows) == \
        H * BS * D * 2                                    # a bf16 value per token, head and channel


def test_a_working_set_written_in_pieces_holds_every_chosen_tokens_bytes(monkeypatch):
    """``write_history_pages`` gathers and packs ``WRITE_AT_ONCE`` positions at a time:
    a run of several pieces and a partial last one reads back, position by
    position, the bytes of the tokens chosen (repeats too)."""
    from kvreel.connector.retrieval import working_set
    lh, k, v = history()
    lh.append(pages_of(k, v), 0)
    monkeypatch.setattr(working_set, "WRITE_AT_ONCE", 2 * BS)
    tokens = torch.randint(0, 12 * BS, (H, 7 * BS), generator=torch.Generator().manual_seed(5))
    pages = torch.zeros(7, H, 2 * BS, D, dtype=torch.bfloat16)
    working_set.write_history_pages(pages, lh, tokens)
    got_k, got_v = packing().unpack(pages)
    for h in range(H):
        assert torch.equal(got_k[:, h].view(torch.int16), k[tokens[h], h].view(torch.int16))
        assert torch.equal(got_v[:, h].view(torch.int16), v[tokens[h], h].view(torch.int16))


def test_the_host_budget_is_charged_what_a_history_block_holds():
    from kvreel.connector.retrieval.history import history_bytes_per_block
    from kvreel.connector.retrieval.scoring import scoring_dtype
    lh, k, v = history(blocks=16)
    pages = pages_of(k, v)
    lh.append(pages, 0)                                   # 16 blocks at once: nothing reserved beyond them
    per_block = history_bytes_per_block(pages[0].numel() * pages.element_size(), lh.packing)
    assert lh.reserved_bytes == 16 * per_block - H * BS * 8         # the sink block's tokens carry no label
    if scoring_dtype(torch.bfloat16) == torch.float32:   # keys held in float32: twice what the pages take
        assert per_block > 2 * pages[0].numel() * pages.element_size()
    labels = torch.randint(0, 7, (H, 15 * BS))
    lh.set_labels(BS, labels)
    lh.append(pages_of(k[:BS], v[:BS]), 16)               # one more: room to grow into, held or not
    assert lh.nbytes < 17 * per_block < lh.reserved_bytes
    assert lh.keys.shape[1] == 20 * BS                    # a quarter more, not twice
    assert torch.equal(lh.labels, torch.cat([labels, torch.full((H, BS), -1)], 1))    # kept as the room grew


def test_a_prompts_history_is_reserved_once_at_its_length():
    lh, k, v = history(blocks=20)
    pages = pages_of(k, v)
    for first in range(0, 20, 4):                         # a chunk at a time, its length known
        lh.append(pages[first:first + 4], first, room=20 * BS)
        assert lh.keys.shape[1] == 20 * BS and lh.pages.shape[0] == 20 and lh.bounds.shape[2] == 20
        assert lh.labels.shape == (H, (first + 3) * BS) and bool((lh.labels == -1).all())
    assert torch.equal(lh.pages.view(torch.int16), pages.view(torch.int16))


def test_a_requests_room_holds_its_prompt_and_answer_so_decoding_never_moves_it():
    from kvreel.scheduler.history_plan import HistoryPlanner, room_tokens
    assert (room_tokens(4000, 100), room_tokens(4000, 10 ** 6), room_tokens(4000, 0)) == (4100, 5000, 4000)
    planner = HistoryPlanner(BS, window_tokens=64, min_tokens=256)
    planner.plan("r", 512, list(range(17)), prompt_tokens=600, max_tokens=90)
    [op] = planner.take_step().appends
    assert (op.first_block, op.room_blocks) == (0, (690 - 64) // BS)
    assert op.reach_blocks == (690 - 64) // BS            # the most its history can hold: prompt and answer
    planner.plan("long", 512, list(range(17)), prompt_tokens=600, max_tokens=10 ** 6)
    [op] = planner.take_step().appends
    assert (op.room_blocks, op.reach_blocks) == ((750 - 64) // BS, (600 + 10 ** 6 - 64) // BS)
    lh, k, v = history(blocks=20)
    pages = pages_of(k, v)
    lh.append(pages[:16], 0, room=19 * BS)                # the prompt's blocks; room for three answer blocks
    held = [t.data_ptr() for t in (lh.keys, lh.pages, lh.bounds, lh._labels)]
    for b in range(16, 19):                               # decoding: a block at a time, within the room
        lh.append(pages[b:b + 1], b, room=19 * BS)
        assert [t.data_ptr() for t in (lh.keys, lh.pages, lh.bounds, lh._labels)] == held
    lh.append(pages[19:], 19, room=19 * BS)               # past it: the room grows (a copy)
    assert lh.keys.data_ptr() != held[0]
    assert torch.equal(lh.pages[:20].view(torch.int16), pages.view(torch.int16))


def test_an_answer_that_may_outgrow_its_room_grows_one_layers_room_a_step():
    """Decoding past a room cut at a quarter of the prompt: layer l grows its room
    when the history comes within l / layers of an eighth of it, so no step copies
    every layer, and no room grows past what the answer can reach; in prefill, or
    where the answer fits, no room grows early."""
    from kvreel.connector.retrieval.history import RequestHistory
    from kvreel.scheduler.history_plan import HistoryPlanner
    planner = HistoryPlanner(BS, window_tokens=64, min_tokens=256)
    for computed, max_tokens, most in ((512, 10 ** 6, 0), (1025, 10 ** 6, (1024 + 10 ** 6 - 64) // BS),
                                       (1025, 250, 0)):
        planner.plan(f"r{computed}/{max_tokens}", computed, list(range(40)), prompt_tokens=1024,
                     max_tokens=max_tokens)
        [op] = planner.take_step().appends
        assert op.most_blocks == most
    _, k, v = history(blocks=44)
    pages = pages_of(k, v)
    hist = RequestHistory(4, H, BS, D, torch.bfloat16, packing())
    hist.append([pages[:32]] * 4, room=40 * BS)           # the prompt; room for 8 answer blocks
    grew_at = {}
    for b in range(32, 44):                               # decoding, a block at a time
        caps = [lh.keys.shape[1] for lh in hist.layers]
        hist.append([pages[b:b + 1]] * 4, room=40 * BS, most=44 * BS)
        grew = [layer for layer, lh in enumerate(hist.layers) if lh.keys.shape[1] != caps[layer]]
        assert len(grew) <= 1
        grew_at.update({layer: b for layer in grew})
    # layer l grows l * (40 bs / 8) / 4 tokens ahead of need: blocks 40, 39, 38, 37
    assert grew_at == {0: 40, 1: 39, 2: 38, 3: 37}
    for lh in hist.layers:
        assert lh.keys.shape[1] == 44 * BS                # the most it can reach, not a quarter more
        assert torch.equal(lh.pages[:44].view(torch.int16), pages.view(torch.int16))
    kept = RequestHistory(4, H, BS, D, torch.bfloat16, packing())
    kept.append([pages[:32]] * 4, room=40 * BS)
    for b in range(32, 40):                               # within its room: nothing grows
        kept.append([pages[b:b + 1]] * 4, room=40 * BS)
    assert [lh.keys.shape[1] for lh in kept.layers] == [40 * BS] * 4


def test_clusters_follow_the_labels_and_rank_the_candidates():
    """Centroids are the labelled keys' means, also after every label changed (a
    Mosaic split); candidates are the tokens of the clusters the rows rank best,
    unlabelled tokens first."""
    lh, k, v = history(blocks=6)
    lh.append(pages_of(k, v), 0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 4, (H, 5 * BS), generator=g)
    lh.set_labels(BS, labels[:, :3 * BS])                       # the DRE labels in pieces, in order
    lh.set_labels(4 * BS, labels[:, 3 * BS:])
    keys = k[BS:].transpose(0, 1).float()
    for h in range(H):
        for c in range(4):
            members = keys[h][labels[h] == c]
            assert int(lh.counts[h, c]) == len(members)
            assert torch.allclose(lh.sums[h, c], members.sum(0), atol=1e-3)
    lh.candidates(torch.randn(H, 2, D, generator=g), BS)        # ranks by the clusters as they were
    relabelled = (labels + 1) % 5                                # a split: every label anew, one more cluster
    lh.set_labels(BS, relabelled)
    assert torch.allclose(lh.sums[0, 4], keys[0][relabelled[0] == 4].sum(0), atol=1e-3)
    assert int(lh.counts.sum()) == H * 5 * BS
    # a row that points at cluster 2's centroid of head 0 gets cluster 2's tokens first
    q = torch.zeros(H, 3, D)
    q[0, 1] = lh.sums[0, 2] / lh.counts[0, 2] * 4
    cand = lh.candidates(q, int(lh.counts[0, 2]))
    assert sorted(cand[0].tolist()) == (torch.nonzero(relabelled[0] == 2).flatten() + BS).tolist()
    fresh, _, _ = history(blocks=6)
    fresh.append(pages_of(k, v), 0)
    fresh.set_labels(BS, labels[:, :2 * BS])                     # the rest not labelled yet: candidates first
    assert sorted(fresh.candidates(q, 3 * BS)[1].tolist()) == list(range(3 * BS, 6 * BS))


@pytest.mark.parametrize("rows", [4, 45])
def test_candidates_are_a_top_count_of_the_tokens_ranked_by_their_cluster(rows):
    """The cluster index takes whole clusters in rank order (the last one in
    part): the same tokens as ranking every token by its cluster's place (the
    better of its place by centroid share and by bound share, softmaxes over
    all rows at once: the ranking's blocks of rows, the last one partial, change
    nothing) and keeping the best ``count``; tokens labelled after it was built
    are always candidates, and a relabelling regroups at once."""
    import math

    from kvreel.connector.retrieval.scoring import ROWS_AT_ONCE
    assert ROWS_AT_ONCE < rows < 2 * ROWS_AT_ONCE or rows < ROWS_AT_ONCE
    lh, k, v = history(blocks=24)
    lh.append(pages_of(k, v), 0)
    n = lh.num_tokens - BS
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 40, (H, n), generator=g)
    lh.set_labels(BS, labels[:, :n - 3 * BS])                    # the newest three blocks not labelled yet
    q = torch.randn(H, rows, D, generator=g)

    def rank_of_every_token():
        """Each token's cluster's place (lower: better); -1 for tokens not grouped yet."""
        sizes = lh.counts.clamp_min(1)
        means = lh.sums / sizes.unsqueeze(-1)
        share = torch.softmax(torch.bmm(q, means.transpose(1, 2)) * D ** -0.5 + sizes.log().unsqueeze(1),
                              -1).amax(1) / sizes
        keys = lh.keys[:, BS:lh.num_tokens].float()
        bound = torch.full((H, q.shape[1], share.shape[1]), -math.inf)      # from the members themselves
        for h in range(H):
            for c in range(share.shape[1]):
                members = keys[h][lh.labels[h] == c]
                if len(members):
                    box = torch.where(q[h] > 0, members.amax(0), members.amin(0))               # [R, D]
                    bound[h, :, c] = (q[h] * box).sum(-1) * D ** -0.5
        best = torch.softmax(bound, -1).amax(1)
        place = torch.minimum(2 * best.argsort(1, descending=True).argsort(1),
                              2 * share.argsort(1, descending=True).argsort(1) + 1)
        lab = lh.labels[:, :n]
        return torch.where(lab >= 0, place.gather(1, lab.clamp_min(0)), -1)

    def check_top(cand, count):
        rank = rank_of_every_token()
        for h in range(H):
            chosen = torch.zeros(n, dtype=torch.bool)
            chosen[cand[h] - BS] = True
            assert int(chosen.sum()) == count == cand.shape[1]
            assert int(rank[h][chosen].max()) <= int(rank[h][~chosen].min())

    for count in (3 * BS, 7 * BS + 5, n - 3 * BS):
        check_top(lh.candidates(q, count), count)
    built = lh._index
    lh.set_labels(n - 2 * BS, labels[:, n - 3 * BS:n - 2 * BS])    # a block labelled since: still a candidate
    cand = lh.candidates(q, 8 * BS)
    assert lh._index is built and all(set(range(n - 2 * BS, n + BS)) <= set(cand[h].tolist()) for h in range(H))
    lh.set_labels(BS, (labels + 1) % 41)                         # every label anew (a Mosaic split)
    check_top(lh.candidates(q, 8 * BS), 8 * BS)
    assert lh._index is not built


def test_a_needle_far_from_its_clusters_centroid_is_a_candidate():
    """A key unlike the rest of its cluster (a needle that joined the nearest
    cluster) moves the centroid little: ranked by centroid alone its cluster
    comes last, and a candidate count of a few clusters misses it. The clusters'
    key bounds rank it first for the query that looks for it."""
    lh, k, v = history(blocks=24)
    n, clusters = 23 * BS, 23
    g = torch.Generator().manual_seed(5)
    labels = (torch.arange(n) % clusters).expand(H, n)
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    centres = torch.randn(clusters, D, generator=g)
    centres -= (centres @ u).unsqueeze(1) * u                      # the others: nothing along u
    centres[0] = -u
    keys = centres[labels[0]] + 0.05 * torch.randn(n, D, generator=g)
    needle = 5 * clusters                                            # a token of cluster 0
    keys[needle] = 8 * u
    k[BS:] = keys.unsqueeze(1).expand(n, H, D).bfloat16()
    lh.append(pages_of(k, v), 0)
    lh.set_labels(BS, labels)
    q = (3 * u).expand(H, 1, D).contiguous()
    means = lh.sums / lh.counts.unsqueeze(-1)
    by_centroid = torch.bmm(q, means.transpose(1, 2))[:, 0]
    assert bool((by_centroid.argmin(1) == 0).all())                 # its cluster, last by centroid
    cand = lh.candidates(q, 2 * n // clusters)                      # two clusters' tokens
    assert all(needle + BS in cand[h].tolist() for h in range(H))


def test_a_token_one_row_wants_is_kept_whatever_the_other_rows_want():
    """Per-query selection: in a prefill chunk of 100 rows, one row (a question)
    looks for token 300; the other 99 spread their attention over tokens 0-63.
    A chunk average ranks token 300 below all of them; per row it is kept."""
    from kvreel.connector.retrieval.selection import select_tokens
    g = torch.Generator().manual_seed(2)
    keys = torch.nn.functional.normalize(torch.randn(H, 320, D, generator=g), dim=-1)
    common = keys[:, :1]
    keys[:, :64] = common + 0.01 * torch.randn(H, 64, D, generator=g)    # tokens 0-63: one direction
    queries = torch.zeros(H, 100, D)
    queries[:, :99] = common * 60                                      # spread evenly over tokens 0-63
    queries[:, 99] = keys[:, 300] * 60                                 # the needle
    kept = select_tokens(queries, keys, alpha=0.9, count=64, unit=BS)
    assert kept.shape == (H, 64) and all(300 in row for row in kept.tolist())
    average = torch.softmax(torch.bmm(queries, keys.transpose(1, 2)) * D ** -0.5, -1).mean(1)
    assert bool((average[:, 300:301] < average[:, :64]).all())
    # alpha stops early, in whole pages: one row wanting one token needs one page
    one = select_tokens(queries[:, 99:], keys, alpha=0.5, count=256, unit=BS)
    assert one.shape == (H, BS) and bool((one[:, 0] == 300).all())
    assert select_tokens(queries, keys, alpha=1.0, count=256, unit=BS).shape == (H, 256)     # the budget caps


@pytest.mark.parametrize("rows,group_rows", [(23, 5), (100, 40), (64, 32), (7, 24)])
def test_groups_selected_together_choose_what_each_would_alone(rows, group_rows):
    """``select_in_groups`` scores every group's rows in shared passes over the
    keys (whole groups per pass, or a group over several passes, a short last
    group): each group gets the tokens ``select_tokens`` gives its rows alone."""
    from kvreel.connector.retrieval.selection import select_in_groups, select_tokens
    g = torch.Generator().manual_seed(rows)
    keys = torch.randn(H, 640, D, generator=g)
    queries = torch.randn(H, rows, D, generator=g) * 2
    for alpha, count in ((0.9, 256), (0.5, 256), (1.0, 96)):
        together = select_in_groups(queries, keys, alpha, count, BS, group_rows)
        alone = [select_tokens(queries[:, a:a + group_rows], keys, alpha, count, BS)
                 for a in range(0, rows, group_rows)]
        assert len(together) == len(alone)
        for t, o in zip(together, alone):
            assert t.shape == o.shape and t.shape[1] % BS == 0
            assert all(set(x) == set(y) for x, y in zip(t.tolist(), o.tolist()))


@pytest.mark.parametrize("native", [False, True])
def test_16bit_keys_are_scored_in_float32_where_the_cpu_lacks_16bit_products(monkeypatch, native):
    """Without hardware bf16 products the keys are scored in float32, a block of
    keys converted at a time (the choice is that of the same keys given as
    float32); with them the keys are scored as they are."""
    from kvreel.connector.retrieval import scoring, selection
    monkeypatch.setattr(scoring, "_native_half_products", lambda: native)
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(H, 640, D, generator=g).to(torch.bfloat16)
    queries = (torch.randn(H, 40, D, generator=g) * 2).to(torch.bfloat16)
    assert (scoring.scoring_dtype(keys.dtype) == torch.float32) is not native
    assert scoring.scoring_dtype(torch.float32) == torch.float32
    if not native:
        monkeypatch.setattr(selection, "SCORE_BLOCK", 100)        # several blocks, a short last one
        for alpha, group_rows in ((0.9, 8), (0.9, 40), (1.0, 16)):
            half = selection.select_in_groups(queries, keys, alpha, 256, BS, group_rows)
            full = selection.select_in_groups(queries.float(), keys.float(), alpha, 256, BS, group_rows)
            assert all(torch.equal(a, b) for a, b in zip(half, full))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_choices_made_in_reused_scratch_memory_are_those_made_in_fresh_memory(monkeypatch, dtype):
    """The runtime's choices write their temporaries (a prefill chunk's scoring
    passes, a decoding step's candidates' keys) into one ``Scratch`` kept across
    layers and steps: the same tokens and blocks as with fresh tensors, for keys
    scored as they are (here also bf16) given as a slice of the history's, and
    the memory is reused, not allocated again."""
    from kvreel.connector.retrieval import scoring
    from kvreel.connector.retrieval.scoring import Scratch
    from kvreel.connector.retrieval.selection import choose_blocks, select_in_groups
    monkeypatch.setattr(scoring, "_native_half_products", lambda: True)     # bf16 scored as bf16
    g = torch.Generator().manual_seed(9)
    held = torch.randn(H, 900, D, generator=g).to(dtype)
    keys = held[:, 100:740]                                                   # heads a capacity apart
    queries = (torch.randn(H, 40, D, generator=g) * 2).to(dtype)
    scratch = Scratch()
    for alpha, group_rows in ((0.9, 8), (0.9, 24), (1.0, 16)):
        fresh = select_in_groups(queries, keys, alpha, 256, BS, group_rows)
        reused = select_in_groups(queries, keys, alpha, 256, BS, group_rows, scratch)
        assert all(torch.equal(a, b) for a, b in zip(fresh, reused))
    lh, k, v = history(blocks=40, seed=4)
    lh.append(pages_of(k, v), 0)
    q = torch.randn(H, 3, D, generator=g).to(lh.keys.dtype) * 3
    for candidates in (2, 8):
        assert torch.equal(choose_blocks(lh, q, 0.9, 4 * BS, candidates),
                           choose_blocks(lh, q, 0.9, 4 * BS, candidates, scratch))
    first = scratch.take("keys", 1000, torch.float32)
    assert scratch.take("keys", 500, torch.float32).data_ptr() == first.data_ptr()     # reused
    assert scratch.take("keys", 3000, torch.float32).numel() == 3000                   # grown where too small
    assert scratch.take("other", 10, torch.float32).data_ptr() != first.data_ptr()    # by name


def test_page_bounds_are_upper_bounds_and_narrow_to_the_block_a_row_looks_for():
    """Each block's channel-wise key bounds (Quest): its bound for a query is at
    least every one of its keys' scores; with 40 blocks narrowed to 2 (one
    wanted by one row of a chunk whose other rows want block 3), both wanted
    blocks are candidates, and choose_tokens keeps the needle. Appended in
    pieces, the bounds are those of the whole history."""
    from kvreel.connector.retrieval.scoring import block_tokens, rows_of
    from kvreel.connector.retrieval.selection import choose_tokens
    lh, k, v = history(blocks=40, seed=3)
    needle, common = 17 * BS + 5, 3 * BS + 1
    k[[needle, common]] = (k[[needle, common]].float() * 4).bfloat16()
    pages = pages_of(k, v)
    lh.append(pages[:7], 0)
    lh.append(pages[7:], 7)
    keys = k.transpose(0, 1).float()                                       # [H, T, D]
    assert torch.equal(lh.bounds[:, :D, :40].transpose(1, 2), keys.view(H, 40, BS, D).amax(2))
    assert torch.equal(lh.bounds[:, D:, :40].transpose(1, 2), keys.view(H, 40, BS, D).amin(2))
    g = torch.Generator().manual_seed(4)
    queries = torch.randn(H, 24, D, generator=g)
    queries[:, :23] = keys[:, common:common + 1] * 3                       # 23 rows want a token of block 3
    queries[:, 23] = keys[:, needle] * 3                                   # one row wants the needle
    q = queries * D ** -0.5
    bound = torch.bmm(torch.cat([q.clamp_min(0), q.clamp_max(0)], -1), lh.bounds[:, :, :40])
    scores = torch.bmm(q, keys.transpose(1, 2)).view(H, 24, 40, BS).amax(-1)
    assert bool((bound >= scores - 1e-4).all())
    blocks = lh.best_blocks(queries, 2)
    assert blocks.shape == (H, 2) and int(blocks.min()) >= 1               # never the sink block
    for h in range(H):
        assert {3, 17} == set(blocks[h].tolist())
    picked = block_tokens(blocks, BS)
    assert torch.equal(lh.block_keys(blocks), rows_of(lh.keys, picked))   # copied by block, the same keys
    kept = choose_tokens(lh, queries, alpha=0.9, count=BS, candidates=2, narrowing="pages")
    assert bool((kept[:, :BS] == torch.arange(BS)).all())                 # the sink block first
    assert all(needle in row for row in kept.tolist())


def test_the_manager_frees_only_what_kvreel_holds_outside_the_window():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvreel.connector.retrieval.offload import LEDGER, HistoryOffloadManager, offloaded_spec
    spec = offloaded_spec(FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16),
                          window_tokens=64, min_tokens=256, in_flight_tokens=128)
    assert spec.skipped_tokens(held_blocks=100, num_computed_tokens=255) == 0           # short: all kept
    assert spec.skipped_tokens(held_blocks=100, num_computed_tokens=640) == (640 - 64) // BS * BS
    assert spec.skipped_tokens(held_blocks=3, num_computed_tokens=640) == 3 * BS          # only what is held
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    mgr = HistoryOffloadManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                                scheduler_block_size=BS)
    assert mgr.max_admission_blocks_per_request == -(-(256 + 2 * 128) // BS)
    mgr.allocate_new_blocks("r", 20 * BS, 20 * BS)
    free = pool.get_num_free_blocks()
    mgr.remove_skipped_blocks("r", 20 * BS)                   # kvreel holds nothing yet: nothing goes
    assert pool.get_num_free_blocks() == free
    LEDGER.hold("r", 8)
    mgr.remove_skipped_blocks("r", 20 * BS)                   # 8 held, all outside the window
    assert pool.get_num_free_blocks() == free + 8
    assert [b.is_null for b in mgr.req_to_blocks["r"][:9]] == [True] * 8 + [False]
    mgr.free("r")
    assert LEDGER.held("r") == 0                              # a new admission holds anew


def test_histories_are_charged_to_the_host_budget_and_push_chunks_to_disk(tmp_path, caplog):
    from kvreel.connector.config import KVReelConfig
    from kvreel.scheduler.kvreel_scheduler import Chunk, KVReelScheduler
    from kvreel.connector.tiers import Tier
    cfg = KVReelConfig.load(env={"KVREEL_RETRIEVAL": "resv", "KVREEL_CPU_BYTES": "10KiB",
                                 "KVREEL_DISK_DIR": str(tmp_path), "KVREEL_DISK_BYTES": "1MiB",
                                 "KVREEL_CHUNK_TOKENS": "32"})
    sched = KVReelScheduler(cfg, "model", block_size=32, bytes_per_block=1024)
    chunks = [Chunk(bytes([i]) * 16, [bytes([i])], 1024) for i in range(8)]
    for chunk in chunks:
        assert sched.store.admit(chunk, Tier.HOST) and sched.store.admit(chunk, Tier.DISK)
    chunks[0].pins = 1
    sched.history.planned["long"] = 5                    # 5 KiB of history: 3 LRU chunks leave host memory
    sched._account_histories()
    assert sched.host.used == 10 * 1024
    assert [Tier.HOST in c.tiers for c in chunks] == [True, False, False, False, True, True, True, True]
    assert all(Tier.DISK in c.tiers for c in chunks)                # their disk copies stay
    assert sched.store.evictions[Tier.HOST] == [c.key for c in chunks[1:4]]
    sched.history.planned["long"] = 20                   # past the budget: every unpinned chunk goes, it says so
    sched._account_histories()
    assert [Tier.HOST in c.tiers for c in chunks] == [True] + [False] * 7
    assert "exceed KVREEL_CPU_BYTES" in caplog.text
    sched.history.forget("long")                          # the session ended: its room comes back
    sched._account_histories()
    assert sched.host.used == 1024


def test_the_host_budget_is_charged_what_the_workers_say_histories_take(tmp_path):
    """The planned blocks' bytes leave out the room a history grows into and its
    clusters' key sums: the workers' report counts them, and is charged where it
    is more; the worker reports a change once."""
    from scheduler_stand_ins import worker_said

    from kvreel.connector.config import KVReelConfig
    from kvreel.connector.metadata import KVReelWorkerMeta
    from kvreel.connector.retrieval.history import RequestHistory
    from kvreel.scheduler.kvreel_scheduler import KVReelScheduler
    from kvreel.connector.worker_side.reports import WorkerReports
    cfg = KVReelConfig.load(env={"KVREEL_RETRIEVAL": "resv", "KVREEL_CPU_BYTES": "1MiB", "KVREEL_CHUNK_TOKENS": "32"})
    sched = KVReelScheduler(cfg, "model", block_size=32, bytes_per_block=1024)
    sched.history.planned["long"] = 5
    sched._account_histories()
    assert sched.host.used == 5 * 1024                    # no report yet: the planned blocks
    worker_said(sched, history_bytes=9000)
    sched._account_histories()
    assert sched.host.used == 9000
    worker_said(sched, history_bytes=100)                 # below the planned blocks' bytes: those
    sched._account_histories()
    assert sched.host.used == 5 * 1024
    merged = KVReelWorkerMeta(history_bytes=7).aggregate(KVReelWorkerMeta()).aggregate(KVReelWorkerMeta(history_bytes=9))
    assert merged.history_bytes == 9 and not merged.is_empty() and KVReelWorkerMeta().is_empty()

    reports = WorkerReports()                             # the worker's side of it
    assert reports.take_meta({}) is None
    hist = RequestHistory(2, H, BS, D, torch.bfloat16, packing())
    hist.layers[0].append(pages_of(torch.randn(4 * BS, H, D).bfloat16(), torch.randn(4 * BS, H, D).bfloat16()), 0)
    reports.histories_take(hist.reserved_bytes)
    assert reports.take_meta({}).history_bytes == hist.reserved_bytes > 4 * hist.layers[0].pages[0].nbytes
    reports.histories_take(hist.reserved_bytes)
    assert reports.take_meta({}) is None                  # unchanged: not said again


def test_a_long_prefix_is_not_loaded_from_the_remote_tier_into_vllms_cache(tmp_path):
    """Remote blocks outside a long request's window would land in vLLM's cache
    (histories load from the local tiers): one such request could fill the cache
    and never run. They are recomputed; remote blocks inside the window still load."""
    import time
    from types import SimpleNamespace
    from kvreel.codec.formats import chunk_key
    from kvreel.codec.forms import StoredForms
    from kvreel.connector.config import KVReelConfig
    from kvreel.scheduler.kvreel_scheduler import KVReelScheduler
    from kvreel.connector.tiers.remote import RemoteTier
    url = f"file://{tmp_path / 'store'}"
    tier = RemoteTier(url, StoredForms("model"), 2.0, 4)
    hashes = [bytes([7, j]) * 16 for j in range(16)]
    tier.put(chunk_key(hashes), hashes, torch.zeros(1, 16, 64, dtype=torch.uint8))
    assert tier.flush(120)
    tier.close()

    def matched(retrieval: str, num_tokens: int, request_id: str) -> int:
        cfg = KVReelConfig.load(env={"KVREEL_RETRIEVAL": retrieval, "KVREEL_RETRIEVAL_MIN_TOKENS": "64",
                                     "KVREEL_RETRIEVAL_WINDOW": "64", "KVREEL_CPU_BYTES": "1MiB",
                                     "KVREEL_REMOTE_URL": url})
        sched = KVReelScheduler(cfg, "model", block_size=32, bytes_per_block=64)
        request = SimpleNamespace(request_id=request_id, block_hashes=hashes[:num_tokens // 32],
                                  num_tokens=num_tokens)
        deadline = time.monotonic() + 10
        while (got := sched.get_num_new_matched_tokens(request, 0)[0]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sched.remote.close()
        return got
    assert matched("off", 16 * 32 + 5, "a") == 16 * 32                 # without retrieval: all 16 blocks load
    assert matched("resv", 16 * 32 + 5, "b") == 0                      # 13 of them outside the window: recompute
    assert matched("resv", 2 * 32 + 5, "c") == 2 * 32                  # all inside the window: they load
