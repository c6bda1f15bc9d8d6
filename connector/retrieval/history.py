"""The host-memory history of a long session (KVMU, V-Rex's memory unit).

Blocks that left a long request's local window live here, not in vLLM's
paged cache: per layer, the pages as vLLM packed them (the first block, the
attention sinks, included), and per KV head every token's key in token order
(``[H, T, D]``), unpacked once as they arrive, in the dtype a step scores them
in (``scoring_dtype``): on a CPU without 16-bit products, 16-bit keys are
held in float32, converted once rather than by every step that scores them
(a sixth of a decode step's choice at 16 K tokens). A step reads only what
it attends to: a decoding step's whole blocks are page copies
(``WorkingSet.hold_blocks``); a prefill group's chosen tokens are written
into working-set pages in vLLM's packing (``write_history_pages``). Their
values are read from the pages where vLLM's packing keeps a token's values in
one row (a row copy); where it interleaves them (the AMX kernel's pairs of
tokens), every value in token order too, unpacked once as they arrive rather
than gathered element by element through the packing at every step.

The DRE labels every token after the sink block with its cluster (ReSV's hash
bits or Mosaic's semantic clusters); the history keeps each cluster's key sum
and size per head, so a step can rank clusters by ``q . centroid`` and score
exactly only the tokens of the best ones (``candidates``). Tokens the DRE has
not labelled yet are always candidates. It also keeps every block's
channel-wise key bounds (Quest's page bounds), so a step can instead rank
blocks by the most any of their keys could score (``best_blocks``)."""

from __future__ import annotations

import math

import torch

from kvreel.connector import freed_memory
from kvreel.connector.retrieval.cluster_ranking import ClusterIndex, fold_log_shares, merged
from kvreel.connector.retrieval.page_packing import PagePacking
from kvreel.connector.retrieval.scoring import ROWS_AT_ONCE, Scratch, rows_of, scoring_dtype
from kvreel.dre.tensors import grown


def history_bytes_per_block(page_bytes: int, packing: PagePacking) -> int:
    """Host memory a history block takes, for ``page_bytes`` of its cache pages (all
    layers, packed as ``packing`` packs them): the pages, and per head every token's
    key in the dtype it is scored in, the block's channel-wise key bounds (float32)
    and its tokens' cluster labels (int64); where the packing does not keep a
    token's values in a row, every token's values too. Keys held in float32 beside
    16-bit pages double what the pages alone take."""
    bs, D, dtype = packing.block_size, packing.head_dim, packing.dtype
    page = 2 * bs * D * dtype.itemsize                                # one head's share of a page
    extra = bs * D * scoring_dtype(dtype).itemsize + 2 * D * 4 + bs * 8
    if not packing.values_in_rows:
        extra += bs * D * dtype.itemsize
    return page_bytes * (page + extra) // page


class LayerHistory:
    """One layer's history of one request."""

    def __init__(self, heads: int, block_size: int, head_dim: int, dtype: torch.dtype, packing: PagePacking):
        self.heads, self.block_size, self.head_dim, self.dtype = heads, block_size, head_dim, dtype
        self.packing = packing
        self.keys = torch.empty(heads, 0, head_dim, dtype=scoring_dtype(dtype))   # [H, capacity, D], token order
        # [H, capacity, D] in token order where the pages do not keep a token's values in a row, else None
        self.values = None if packing.values_in_rows else torch.empty(heads, 0, head_dim, dtype=dtype)
        self.pages = torch.empty(0, heads, 2 * block_size, head_dim, dtype=dtype)    # [capacity blocks, ...]
        self.num_tokens = 0                                           # sink block included
        self._labels = torch.empty(heads, 0, dtype=torch.int64)       # room for ``labels``
        self.sums = torch.zeros(heads, 0, head_dim)                   # per cluster: key sum (float32),
        self.counts = torch.zeros(heads, 0)                           # size,
        self.key_max = torch.zeros(heads, 0, head_dim)                # and channel-wise key bounds
        self.key_min = torch.zeros(heads, 0, head_dim)
        self._index: ClusterIndex | None = None
        self._tables: tuple[torch.Tensor, ...] | None = None          # the clusters' ranking tables (``candidates``)
        self._labelled_since = 0                                      # tokens labelled since it was built
        # per block: channel-wise key max, then min (float32), channel-major [H, 2 D, capacity]: ranking
        # the blocks (``best_blocks``) is then a product with contiguous rows; blocks-major bounds read
        # transposed took 1.6x as long (2 047 blocks of 2 heads, cold caches, AVX2 core: 0.76 vs 0.47 ms)
        self.bounds = torch.empty(heads, 2 * head_dim, 0)

    @property
    def labels(self) -> torch.Tensor:
        """Per head, every token's cluster after the sink block ``[H, T - bs]`` (-1:
        unlabelled); a view into room reserved with the keys', so an append writes
        its tokens' labels rather than copying all of them (a history's appends
        would otherwise copy O(T^2) labels)."""
        return self._labels[:, :max(0, self.num_tokens - self.block_size)]

    @property
    def nbytes(self) -> int:
        per_token = self.keys.element_size() + (2 if self.values is None else 3) * self.pages.element_size()
        return self.heads * self.num_tokens * self.head_dim * per_token

    @property
    def reserved_bytes(self) -> int:
        """Bytes of every tensor it keeps, with the room reserved to grow into."""
        return sum(t.nbytes for t in (self.keys, self.values, self.pages, self.bounds, self._labels, self.sums,
                                      self.counts, self.key_max, self.key_min) if t is not None)

    def append(self, pages: torch.Tensor, first_block: int, room: int = 0, most: int = 0,
               ahead: float = 0.0) -> torch.Tensor:
        """Append cache pages ``[n, H, 2 bs, D]`` of blocks ``first_block...``; the
        keys of their tokens after the sink block ``[H, m, D]`` (float32, for the DRE).
        ``room``: the tokens the history is known to reach (its prompt's), reserved at once;
        ``most`` (0: unknown): the most it can reach, which its room never grows past;
        below it, grow ``ahead`` (in [0, 1)) that share of an eighth of the room before it is full."""
        if first_block * self.block_size != self.num_tokens:
            raise ValueError(f"history holds {self.num_tokens} tokens, got blocks from {first_block}")
        k = self.packing.unpack_part(pages, 0)                            # [n bs, H, D]
        n = k.shape[0]
        cap = self.keys.shape[1]
        early = int(ahead * cap / 8) // self.block_size * self.block_size if most > cap else 0
        self._reserve(max(self.num_tokens + n + early, room), most)
        self.keys[:, self.num_tokens:self.num_tokens + n] = k.transpose(0, 1)
        if self.values is not None:
            self.values[:, self.num_tokens:self.num_tokens + n] = self.packing.unpack_part(pages, 1).transpose(0, 1)
        blocks = k.view(n // self.block_size, self.block_size, self.heads, self.head_dim).float()
        first, last = self.num_tokens // self.block_size, (self.num_tokens + n) // self.block_size
        self.pages[first:last] = pages
        self.bounds[:, :, first:last] = torch.cat([blocks.amax(1), blocks.amin(1)], -1).permute(1, 2, 0)
        labelled = self.labels.shape[1]
        self.num_tokens += n
        self._labels[:, labelled:self.num_tokens - self.block_size] = -1
        if first_block == 0:
            k = k[self.block_size:]
        return k.transpose(0, 1).float()

    def _reserve(self, tokens: int, most: int = 0) -> None:
        """Room for ``tokens``, and a quarter more than there was (up to ``most``, when
        known): rooms that doubled held up to 1.6x a prefilled history's bytes (a
        prompt's history grows a chunk at a time; ``bench/engine_memory.py``), where
        growing by a quarter costs a few more copies of what is held."""
        cap = self.keys.shape[1]
        if tokens <= cap:
            return
        bs = self.block_size
        new_cap = max(tokens, -(-(cap + cap // 4) // bs) * bs, 16 * bs)
        if most:
            new_cap = max(tokens, min(new_cap, most))
        freed_memory.freed(sum(t.nbytes for t in (self.keys, self.values, self.bounds, self.pages, self._labels)
                               if t is not None))
        blocks, used_blocks = new_cap // self.block_size, self.num_tokens // self.block_size
        self._labels = grown(self._labels, 1, new_cap - bs, self.labels.shape[1])
        self.keys = grown(self.keys, 1, new_cap, self.num_tokens)
        if self.values is not None:
            self.values = grown(self.values, 1, new_cap, self.num_tokens)
        self.bounds = grown(self.bounds, 2, blocks, used_blocks)
        self.pages = grown(self.pages, 0, blocks, used_blocks)

    def token_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, H, D]`` of tokens ``[H, n]`` (per head), as vLLM's
        packing op takes them: row copies out of the keys (and values) in token order,
        or the values through the pages' packing (``PagePacking.values_at``)."""
        H, n = tokens.shape
        rows = (tokens + torch.arange(H).unsqueeze(1) * self.keys.shape[1]).T.flatten()     # [n, H] order
        k = self.keys.view(-1, self.head_dim).index_select(0, rows).view(n, H, -1).to(self.dtype)
        if self.values is None:
            return k, self.packing.values_at(self.pages, tokens)
        return k, self.values.view(-1, self.head_dim).index_select(0, rows).view(n, H, -1)

    def dre_keys(self) -> torch.Tensor:
        """Every key after the sink block ``[H, T - bs, D]`` (float32): to cluster anew."""
        return self.keys[:, self.block_size:self.num_tokens].float()

    def set_labels(self, first_token: int, labels: torch.Tensor) -> None:
        """Cluster labels ``[H, n]`` of history tokens ``first_token...`` (token ids,
        sink block excluded); the clusters' key sums, sizes and bounds follow."""
        start = first_token - self.block_size
        end = start + labels.shape[1]
        relabel = bool((self.labels[:, start:end] >= 0).any())
        self.labels[:, start:end] = labels
        if relabel:
            self._index = None                        # clusters' members moved: regroup
        self._labelled_since += end - start
        self._tables = None
        clusters = int(labels.max()) + 1 if labels.numel() else 0
        if clusters > self.sums.shape[1]:
            grow = (self.heads, clusters - self.sums.shape[1], self.head_dim)
            self.sums = torch.cat([self.sums, torch.zeros(grow)], 1)
            self.counts = torch.cat([self.counts, torch.zeros(grow[:2])], 1)
            self.key_max = torch.cat([self.key_max, torch.full(grow, -math.inf)], 1)
            self.key_min = torch.cat([self.key_min, torch.full(grow, math.inf)], 1)
        if relabel:                                   # Mosaic split clusters: every sum and bound anew
            self.sums.zero_()
            self.counts.zero_()
            self.key_max.fill_(-math.inf)
            self.key_min.fill_(math.inf)
            start, end = 0, self.num_tokens - self.block_size
        keys = self.keys[:, self.block_size + start:self.block_size + end].float()
        for h in range(self.heads):
            lab = self.labels[h, start:end]
            ok = lab >= 0
            members, k = lab[ok], keys[h][ok]
            self.sums[h].index_add_(0, members, k)
            self.counts[h].index_add_(0, members, torch.ones(len(members)))
            channels = members.unsqueeze(1).expand_as(k)
            self.key_max[h].scatter_reduce_(0, channels, k, "amax")
            self.key_min[h].scatter_reduce_(0, channels, k, "amin")

    def candidates(self, queries: torch.Tensor, count: int, scratch: Scratch | None = None) -> torch.Tensor:
        """Per head, ``count`` history tokens after the sink block ``[H, count]``
        (token ids) from the clusters the query rows ``[H, R, D]`` rank best, two
        ways merged (a cluster at its better place of the two):

        * by centroid: every row spreads its mass over the clusters (softmax of
          ``q . centroid / sqrt D + log size``), a cluster ranks by the largest
          per-token share any row gives it (where the cluster's typical token is);
        * by bound: the most ``q . k`` any key within the cluster's channel-wise
          bounds can reach (Quest's bound, over a cluster instead of a block), as
          a softmax share, the largest any row gives: a needle whose key sits far
          from its cluster's centroid still brings the cluster in.

        Tokens the cluster index does not group yet (unlabelled, or labelled since
        it was built) are always candidates (more than ``count`` of them: all of them).
        Temporaries go in ``scratch`` where given."""
        per_token, best = self._cluster_shares(queries, scratch)
        n = self.num_tokens - self.block_size
        index = self._cluster_index(count)
        always = index.unlabelled + (n - index.built)
        count = min(n, max(count, int(always.max())))
        built = index.sizes.shape[1]
        ranked = merged(torch.argsort(best[:, :built], dim=1, descending=True),
                         torch.argsort(per_token[:, :built], dim=1, descending=True))
        out = torch.empty(self.heads, count, dtype=torch.int64)
        for h in range(self.heads):
            u, a = int(index.unlabelled[h]), int(always[h])
            out[h, :u] = index.order[h, :u]
            out[h, u:a] = torch.arange(index.built, n)
            if count > a:
                out[h, a:] = index.best(h, ranked[h], count - a)
        return out + self.block_size

    def _cluster_shares(self, queries: torch.Tensor, scratch: Scratch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``candidates``: per head and cluster ``[H, C]``, the log of the largest
        per-token centroid share and of the largest bound share any query row gives
        it. Rows are scored ``ROWS_AT_ONCE`` at a time, each block's shares kept as logs
        and folded into a running maximum while they are in the CPU's cache: whole
        ``[H, R, C]`` softmaxes (1 536 rows of 4 096 clusters: 75 MB each, fresh
        memory a call) took 2.7x as long on an AMX core."""
        q = queries.float() * self.head_dim ** -0.5
        means, bounds, size_bias, dead_bias, sizes = self._ranking_tables()
        H, R, _ = q.shape
        per_token = torch.full((H, means.shape[2]), -math.inf)
        best = torch.full_like(per_token, -math.inf)
        rows = min(R, ROWS_AT_ONCE)
        logits = (torch.empty(H * rows * means.shape[2]) if scratch is None else
                  scratch.take("ranking", H * rows * means.shape[2], torch.float32)).view(H, rows, means.shape[2])
        for a in range(0, R, rows):
            block = q[:, a:a + rows]
            out = logits[:, :block.shape[1]]
            fold_log_shares(per_token, torch.baddbmm(size_bias, block, means, out=out))
            signed = torch.cat([block.clamp_min(0), block.clamp_max(0)], -1)                   # [H, r, 2 D]
            fold_log_shares(best, torch.baddbmm(dead_bias, signed, bounds, out=out))
        return per_token.sub_(sizes.log()), best

    def _ranking_tables(self) -> tuple[torch.Tensor, ...]:
        """What ``candidates`` ranks the clusters by, kept until the labels move:
        centroids ``[H, D, C]``, channel-wise bounds ``[H, 2 D, C]`` (max then min;
        0 for a cluster without members), the centroid score's bias ``log size``
        and the bound's ``0`` (``-inf`` for a cluster without members) ``[H, 1, C]``,
        and the sizes ``[H, C]`` (at least 1)."""
        if self._tables is None:
            live = self.counts > 0
            sizes = self.counts.clamp_min(1)
            dead = torch.zeros_like(sizes).masked_fill_(~live, -math.inf).unsqueeze(1)
            self._tables = ((self.sums / sizes.unsqueeze(-1)).transpose(1, 2).contiguous(),
                            torch.cat([self.key_max, self.key_min], -1).nan_to_num_(0, 0, 0).transpose(1, 2)
                            .contiguous(), sizes.log().unsqueeze(1) + dead, dead, sizes)
        return self._tables

    def best_blocks(self, queries: torch.Tensor, count: int) -> torch.Tensor:
        """Per head, the ``count`` blocks after the sink block ``[H, count]`` that the
        query rows ``[H, R, D]`` rank best (fewer where the history has fewer). A
        block's bound for a row is the most ``q . k`` any key inside its channel-wise
        bounds can reach (``q+ . max + q- . min``, Quest: one product of ``[q+, q-]``
        with the bounds side by side), so the block holding a row's best token ranks
        at least as high as that token scores; rows count by their softmax share over
        the blocks (so one row's larger query norm does not outvote the others) and a
        block by the most any row gives it, as ``select_tokens`` ranks tokens."""
        q = queries.float() * self.head_dim ** -0.5
        held = self.num_tokens // self.block_size
        signed = torch.cat([q.clamp_min(0), q.clamp_max(0)], -1)                      # [H, R, 2 D]
        bound = torch.bmm(signed, self.bounds[:, :, 1:held])
        rank = torch.softmax(bound, dim=-1).amax(1)                                    # [H, blocks - 1]
        return torch.topk(rank, min(rank.shape[1], count), dim=1, sorted=False).indices + 1

    def block_keys(self, blocks: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
        """The keys ``[H, n bs, D]`` of ``blocks`` ``[H, n]``, each block's in token
        order (in ``scratch`` where given): copied a block at a time, where
        ``rows_of`` copies a row at a time (4 K rows of a 16 K history: 3-4x the
        time on this machine)."""
        per_block = self.keys[:, :self.num_tokens].view(self.heads, -1, self.block_size * self.head_dim)
        out = None if scratch is None else \
            scratch.take("keys", blocks.numel() * per_block.shape[2], self.keys.dtype).view(*blocks.shape, -1)
        return rows_of(per_block, blocks, out).view(self.heads, -1, self.head_dim)

    def _cluster_index(self, count: int) -> ClusterIndex:
        """The cluster index, rebuilt when labels moved (a Mosaic split) or once
        the tokens labelled since it was built are a quarter of a step's candidates
        (until then they are candidates anyway)."""
        if self._index is None or 4 * self._labelled_since > count:
            self._index = ClusterIndex(self.labels[:, :self.num_tokens - self.block_size])
            self._labelled_since = 0
        return self._index


class RequestHistory:
    """Every layer's history of one request; blocks ``[0, num_blocks)`` are held."""

    def __init__(self, layers: int, heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 packing: PagePacking):
        self.layers = [LayerHistory(heads, block_size, head_dim, dtype, packing) for _ in range(layers)]
        self.num_blocks = 0
        self.block_size = block_size
        self.reach_blocks = 0          # the most blocks it can reach (its prompt and longest answer); 0: unknown

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def reserved_bytes(self) -> int:
        return sum(layer.reserved_bytes for layer in self.layers)

    def append(self, pages: list[torch.Tensor], room: int = 0, most: int = 0) -> list[torch.Tensor]:
        """Every layer's pages ``[n, H, 2 bs, D]`` of the blocks after those held; each
        layer's keys (``LayerHistory.append``). ``most`` (0: unknown): the most tokens
        a decoding history that may outgrow its ``room`` can reach; until its rooms
        hold that, layer l grows its room when it is within l / layers of an eighth
        of full, so a step copies a few layers' histories (layers over the blocks
        of that eighth), not all of them (30 layers of 8 K tokens of a float32
        model with 3 KV heads of 64: about half a GiB in one step), and no room
        grows past it."""
        first = self.num_blocks
        keys = [lh.append(p, first, room, most, layer / len(self.layers))
                for layer, (lh, p) in enumerate(zip(self.layers, pages))]
        self.num_blocks += pages[0].shape[0]
        return keys
