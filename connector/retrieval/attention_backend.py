"""Retrieval attention inside vLLM's CPU backend.

``RetrievalCPUAttentionBackend`` (registered by kvreel's plugin in place of
``CPU_ATTN``) does two things:

* ``customize_spec`` reports the layers' full-attention KV spec as
  ``OffloadedHistorySpec``, so vLLM's KV cache manager frees a long request's
  blocks once they left its window and kvreel holds them
  (``kvreel.connector.retrieval.offload``);
* its impl runs vLLM's own kernel, unchanged, for every request that has no
  offloaded history, and for a long request on the working set the runtime
  builds (``kvreel.connector.retrieval.runtime``): sink and selected history
  pages, then the request's blocks still in vLLM's cache, in order.

Requests below ``KVREEL_RETRIEVAL_MIN_TOKENS`` never have history offloaded, so
their attention, and the KV of every position below the threshold, is vLLM's
own (a short request sharing prefix blocks with a long session reads exact KV).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvreel.connector.retrieval.plugin import engine_settings
from kvreel.connector.retrieval.runtime import RetrievalRuntime
from kvreel.connector.retrieval.selection import narrows
from kvreel.connector.retrieval.working_set import write_history_pages
from kvreel.connector.vllm_internals import cpu_attention_classes, cpu_scheduler_metadata, layer_index

CPUAttentionBackend, CPUAttentionBackendImpl = cpu_attention_classes()

logger = logging.getLogger(__name__)

GROUP_SCRATCH_BYTES = 128 << 20      # a prefill chunk's working sets per kernel call: bounds the scratch pages


class RetrievalAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention; long requests attend to their working sets."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config
        config = get_current_vllm_config()
        self.runtime = RetrievalRuntime.for_layers(engine_settings(config))
        self.runtime.configure_engine(config)
        self.layer_index: int | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        long_rows = self._long_rows(layer, attn_metadata)
        if not long_rows:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        num_rows = len(attn_metadata.seq_lens)
        if len(long_rows) < num_rows:      # the other rows, as vLLM computes them (long rows' outputs replaced)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        self._attend_long(layer, query, kv_cache, attn_metadata, long_rows, output)
        return output

    def _long_rows(self, layer, meta) -> dict[int, str]:
        """Rows of requests with offloaded history: matched by the block that
        holds their newest token (the scheduler names it per step)."""
        rt = self.runtime
        if meta is None or not rt.rows or self.attn_type != AttentionType.DECODER or not meta.causal:
            return {}
        if self.layer_index is None:
            index = layer_index(getattr(layer, "layer_name", ""))
            if index is None:       # its history could not be told apart: never read freed blocks
                raise RuntimeError(f"kvreel: cannot tell the layer number of {layer.layer_name!r}")
            self.layer_index = index
        shared = self._shared(meta)
        if "rows" not in shared:
            bs = rt.block_size
            newest = meta.block_table.gather(1, ((meta.seq_lens.long() - 1) // bs).unsqueeze(1)).flatten().tolist()
            found = {r: rt.rows[b] for r, b in enumerate(newest) if b in rt.rows and rt.rows[b] in rt.histories}
            expected = {req for req in rt.rows.values() if req in rt.histories}
            if set(found.values()) != expected:       # never let a long request read blocks vLLM freed
                raise RuntimeError(f"kvreel: rows of long requests {sorted(expected - set(found.values()))} "
                                   "are not in this batch")
            shared["rows"] = found
        return shared["rows"]

    def _shared(self, meta) -> dict:
        """What every layer of this step works out alike from its metadata ``meta``
        (vLLM builds one per step and KV cache group, shared by the group's
        layers): kept in the runtime, which forgets it when the next step begins."""
        memo = self.runtime.step_memo
        entry = memo.get(id(meta))
        if entry is None or entry[0] is not meta:
            entry = memo[id(meta)] = (meta, {})
        return entry[1]

    def _attend_long(self, layer, query, kv_cache, meta, long_rows: dict[int, str], output) -> None:
        """Long rows attend to their working sets: a request with more query rows
        than ``KVREEL_RETRIEVAL_ROWS_PER_SET`` (a prefill chunk) that selects from
        its history does so in groups of rows (``_attend_in_groups``), or attends
        to all of it where it is too short to be narrowed (``_attend_to_all``);
        the others (decode steps, short chunks, histories within the budget) in one
        kernel call."""
        rt = self.runtime
        qsl = meta.query_start_loc.tolist()
        chunks = {r: req for r, req in long_rows.items()
                  if qsl[r + 1] - qsl[r] > rt.cfg.retrieval_rows_per_set and not rt.exact_for(rt.histories[req])}
        together = {r: req for r, req in long_rows.items() if r not in chunks}
        if together:
            self._attend_together(layer, query, kv_cache, meta, together, output)
        for r, req_id in chunks.items():
            if self._chunk_selects(rt.histories[req_id]):
                self._attend_in_groups(layer, query, kv_cache, meta, r, req_id, output)
            else:
                self._attend_to_all(layer, query, kv_cache, meta, r, req_id, output)

    def _chunk_selects(self, hist) -> bool:
        """Whether a prefill chunk selects from the history ``hist`` rather than attend to
        all of it: always with ``KVREEL_RETRIEVAL_PREFILL_SELECT=always``, else only where
        the history is long enough to be narrowed. Below that, choosing would score every
        history token for each of the chunk's rows (full attention's products already)
        and then rank them: it costs more than attending to them all (a 512-token chunk
        over 8 K tokens of SmolLM2-135M's shape on the development CPU: 120 ms choosing,
        32 ms attending to all)."""
        cfg, n = self.runtime.cfg, hist.num_blocks
        return cfg.retrieval_prefill_select == "always" or narrows(
            cfg.retrieval_candidates, self.runtime.kept_tokens(n), (n - 1) * self.runtime.block_size)

    def _attend_to_all(self, layer, query, kv_cache, meta, r: int, req_id: str, output) -> None:
        """Row ``r``'s chunk attends to its whole history, in token order, then its
        resident blocks (``_chunk_selects`` said it need not select): page copies
        into the runtime's scratch pages, one kernel call. Its history is below the
        narrowing length, which bounds the scratch (``KVREEL_RETRIEVAL_CANDIDATES=0``:
        no bound, a layer's whole history)."""
        rt = self.runtime
        bs, H = rt.block_size, self.num_kv_heads
        start, end = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
        hist = rt.histories[req_id]
        n, seq_len = hist.num_blocks, int(meta.seq_lens[r])
        resident = meta.block_table[r, n:-(-seq_len // bs)].long()
        pages = kv_cache.view(kv_cache.shape[0], H, 2 * bs, -1)
        buffer = rt.scratch(n + len(resident))
        buffer[:n] = hist.layers[self.layer_index].pages[:n]
        torch.index_select(pages, 0, resident, out=buffer[n:])
        qsl = torch.tensor([0, end - start], dtype=meta.query_start_loc.dtype)
        table = torch.arange(n + len(resident), dtype=meta.block_table.dtype).unsqueeze(0)
        sub = self._metadata(layer, meta, query[start:end], qsl, meta.seq_lens[r:r + 1].clone(), table)
        super().forward(layer, query[start:end], None, None, buffer.view(buffer.shape[0], H, bs, -1), sub,
                        output[start:end])
        rt.count_choice(hist, "whole", n, {})

    def _attend_in_groups(self, layer, query, kv_cache, meta, r: int, req_id: str, output) -> None:
        """Row ``r``'s queries in groups of ``KVREEL_RETRIEVAL_ROWS_PER_SET``: a group
        attends to the history its own queries select, then to the request's
        resident blocks up to its last token. A chunk shares no working set, so the
        few rows that ask for a needle are not outvoted by the rest. The groups'
        working sets are written side by side into the runtime's scratch pages, the
        resident blocks once behind them, and one kernel call (a row per group)
        attends to them all, or a few calls where they would take more than
        ``GROUP_SCRATCH_BYTES``."""
        rt = self.runtime
        bs, H, per_set = rt.block_size, self.num_kv_heads, rt.cfg.retrieval_rows_per_set
        start, end = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
        hist = rt.histories[req_id]
        lh = hist.layers[self.layer_index]
        beyond = int(meta.seq_lens[r]) - hist.num_blocks * bs          # tokens after the history, the chunk's too
        pages = kv_cache.view(kv_cache.shape[0], H, 2 * bs, -1)
        resident = meta.block_table[r, hist.num_blocks:-(-int(meta.seq_lens[r]) // bs)].long()
        chosen = rt.choose_in_groups(req_id, self.layer_index, self._by_kv_head(query[start:end]),
                                     per_set * (self.num_heads // H))
        page_bytes = pages[0].numel() * pages.element_size()
        widest = max(c.shape[1] for c in chosen) // bs
        at_once = max(1, (GROUP_SCRATCH_BYTES // page_bytes - len(resident)) // widest)
        for g0 in range(0, len(chosen), at_once):
            groups = chosen[g0:g0 + at_once]
            tokens = torch.cat(groups, 1)                                     # [H, the groups' pages x bs]
            first = tokens.shape[1] // bs
            buffer = rt.scratch(first + len(resident))
            torch.index_select(pages, 0, resident, out=buffer[first:])
            write_history_pages(buffer, lh, tokens)
            m = [c.shape[1] // bs for c in groups]
            a, b = start + g0 * per_set, min(start + (g0 + len(groups)) * per_set, end)
            qsl = torch.tensor([0] + [min((i + 1) * per_set, b - a) for i in range(len(groups))],
                               dtype=meta.query_start_loc.dtype)
            seq_lens = torch.tensor([m_i * bs + beyond - (end - a - int(qsl[i + 1])) for i, m_i in enumerate(m)],
                                    dtype=meta.seq_lens.dtype)
            table = torch.zeros(len(groups), max(m) + len(resident), dtype=meta.block_table.dtype)
            offset = 0
            for i, m_i in enumerate(m):
                table[i, :m_i] = torch.arange(offset, offset + m_i)
                table[i, m_i:m_i + len(resident)] = torch.arange(first, first + len(resident))
                offset += m_i
            sub = self._metadata(layer, meta, query[a:b], qsl, seq_lens, table)
            super().forward(layer, query[a:b], None, None, buffer.view(buffer.shape[0], H, bs, -1), sub,
                            output[a:b])

    def _attend_together(self, layer, query, kv_cache, meta, long_rows: dict[int, str], output) -> None:
        """One kernel call over the layer's working-set buffer with the batch's
        row structure: long rows attend to their working sets, the other rows
        are stand-ins (their outputs are dropped). Keeping every row, with the
        sequence lengths vLLM gave them when the whole history is attended to,
        lets the kernel split the work exactly as it did for vLLM's own call, so
        those results are bit-identical to it."""
        rt = self.runtime
        bs, H = rt.block_size, self.num_kv_heads
        pages = kv_cache.view(kv_cache.shape[0], H, 2 * bs, -1)
        width = rt.slot_pages
        shared = self._shared(meta)
        if "together" not in shared:       # per long row: its query rows, resident blocks, tokens after its history
            qsl = meta.query_start_loc.tolist()
            rows = {}
            for r, req_id in long_rows.items():
                seq_len, held = int(meta.seq_lens[r]), rt.histories[req_id].num_blocks
                rows[r] = (qsl[r], qsl[r + 1], meta.block_table[r, held:-(-seq_len // bs)].long(), seq_len - held * bs)
            shared["together"] = (qsl, rows, {})
        qsl, rows, calls = shared["together"]
        plans = []        # (row, working set, resident blocks, tokens beyond the history)
        for r, req_id in long_rows.items():
            start, end, resident, tail = rows[r]
            plans.append((r, rt.working_set(req_id, self.layer_index, self._by_kv_head(query[start:end])),
                          resident, tail))
        # Normally a request's resident blocks (window + steps in flight) fit its slot
        # beside the working set. A request that arrives with more of its history still
        # in vLLM's cache (a prefix-cache hit kvreel does not hold yet) is attended to
        # from a scratch buffer for this step instead: same pages, one more copy.
        fits = all(ws.m + len(resident) <= width for _, ws, resident, _ in plans)
        if fits:
            for _, ws, resident, _ in plans:
                torch.index_select(pages, 0, resident, out=ws.buffer[ws.m:ws.m + len(resident)])
            sizes = tuple(ws.m for _, ws, _, _ in plans)
            if sizes not in calls:          # the layers that keep as many blocks share the kernel's metadata
                calls[sizes] = self._together_metadata(layer, query, meta, qsl, long_rows, [
                    (r, ws.m, ws.slot * width, len(resident), tail) for r, ws, resident, tail in plans])
            sub, buffer = calls[sizes], rt.buffer(self.layer_index)   # taken last: a new slot may grow it
        else:
            buffer = torch.empty(sum(ws.m + len(res) for _, ws, res, _ in plans), *pages.shape[1:], dtype=pages.dtype)
            at, placed = 0, []
            for r, ws, resident, tail in plans:
                m, n = ws.m, len(resident)
                buffer[at:at + m] = ws.buffer[:m]
                torch.index_select(pages, 0, resident, out=buffer[at + m:at + m + n])
                placed.append((r, m, at, n, tail))
                at += m + n
            sub = self._together_metadata(layer, query, meta, qsl, long_rows, placed)
        out = output if len(long_rows) == len(meta.seq_lens) else torch.empty_like(output)
        super().forward(layer, query, None, None, buffer.view(buffer.shape[0], H, bs, -1), sub, out)
        if out is not output:
            for r in long_rows:
                output[qsl[r]:qsl[r + 1]] = out[qsl[r]:qsl[r + 1]]

    def _together_metadata(self, layer, query, meta, qsl: list[int], long_rows: dict[int, str],
                           placed: list[tuple[int, int, int, int, int]]):
        """The kernel's metadata for ``_attend_together``: each long row ``r`` attends
        to ``m`` working-set pages then ``n`` resident ones, from page ``start`` of
        the buffer, and ``tail`` tokens of its own after the history (``placed``:
        ``(r, m, start, n, tail)``); the other rows keep vLLM's lengths while every
        history block is attended to (bit-identity), else just their queries."""
        rt = self.runtime
        bs = rt.block_size
        seq_lens = meta.seq_lens.clone()
        width = max(rt.slot_pages, meta.block_table.shape[1], *(m + n for _, m, _, n, _ in placed))
        table = torch.zeros(len(seq_lens), width, dtype=meta.block_table.dtype)
        exact = True
        for r, m, start, n, tail in placed:
            seq_lens[r] = m * bs + tail
            table[r, :m + n] = torch.arange(start, start + m + n, dtype=table.dtype)
            exact &= m == rt.histories[long_rows[r]].num_blocks
        if not exact:                     # no bit-identity to keep: the stand-in rows shrink to their queries
            for r in set(range(len(seq_lens))) - set(long_rows):
                seq_lens[r] = qsl[r + 1] - qsl[r]
        return self._metadata(layer, meta, query, meta.query_start_loc, seq_lens, table)

    def _by_kv_head(self, q: torch.Tensor) -> torch.Tensor:
        """Query rows ``[R, heads, D]`` as ``[kv heads, R x heads per kv head, D]``: what selection scores."""
        H = self.num_kv_heads
        return q.reshape(q.shape[0], H, self.num_heads // H, -1).permute(1, 0, 2, 3).reshape(H, -1, q.shape[-1])

    def _metadata(self, layer, meta, query, qsl, seq_lens, block_table):
        return dataclasses.replace(
            meta, num_actual_tokens=int(qsl[-1]), max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            query_start_loc=qsl, seq_lens=seq_lens, max_seq_len=int(seq_lens.max()), block_table=block_table,
            scheduler_metadata=cpu_scheduler_metadata(
                num_reqs=len(seq_lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=seq_lens, dtype=query.dtype, query_start_loc=qsl,
                causal=meta.causal, sliding_window_size=self.sliding_window, isa=layer.isa,
                kv_cache_dtype=self.kv_cache_dtype))


class RetrievalCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend whose long requests' history lives in kvreel;
    vLLM's own, unchanged, in an engine without kvreel's retrieval."""

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        from vllm.config import get_current_vllm_config
        return RetrievalAttentionImpl if engine_settings(get_current_vllm_config()) else CPUAttentionBackendImpl

    @classmethod
    def customize_spec(cls, spec):
        """Full-attention layers report ``OffloadedHistorySpec`` (with kvreel's
        retrieval on; the layers' impls noted the engine's settings)."""
        spec = super().customize_spec(spec)
        rt = RetrievalRuntime.built()
        if rt is None or type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            return spec
        from kvreel.connector.retrieval.offload import offloaded_spec
        cfg = rt.cfg
        return offloaded_spec(spec, window_tokens=cfg.retrieval_window, min_tokens=cfg.retrieval_min_tokens,
                              in_flight_tokens=rt.max_batched_tokens)
