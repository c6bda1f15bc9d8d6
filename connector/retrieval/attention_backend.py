"""Retrieval attention inside vLLM: sink + selected history + local window.

``RetrievalCPUAttentionBackend`` wraps vLLM's CPU attention backend (the
plugin registers it in place of ``CPU_ATTN``). For a sequence of at least
``KVREEL_RETRIEVAL_MIN_TOKENS`` tokens, every layer attends to the first block
(attention sinks), the history blocks the DRE selected (WiCSum over blocks by
their tokens' cluster-predicted attention mass), and the newest blocks (the step's own tokens plus ``KVREEL_RETRIEVAL_WINDOW``):
the request's block-table row is rewritten to those blocks, in order, and vLLM's
own kernel runs on it. Keys are post-RoPE, so dropping blocks moves no position;
the step's tokens stay last, so causal masking is unchanged.

Selections come from the DRE service (its own process), which holds a table of
each layer's history: clustered when it first sees the history, extended with
the new blocks as a session grows (the retriever names a history by its blocks,
so it can tell a grown one from another). At layer l the
connector asks for layer l's selection with layer l's queries (unless layer l-1
already asked with its queries: the cross-layer prefetch) and for layer l+1's
with the same queries, so the DRE works while attention runs. Attention waits
at most ``KVREEL_RETRIEVAL_DEADLINE_MS``; a late answer or a dead DRE means full
attention for that step (counted, logged; the DRE is restarted in the
background). Retrieval off, alpha = 1 or short sequences: vLLM's code path,
untouched (bit-identical outputs).

Only steps whose every query sits at or beyond ``KVREEL_RETRIEVAL_MIN_TOKENS``
use retrieval (a prefill chunk that starts below it attends fully). So the KV
of every position below the threshold is exactly vLLM's, and a short request
that shares prefix blocks with a long session (through vLLM's prefix cache or
kvreel's tiers) never reads KV computed with partial attention: a block
computed with retrieval lies beyond the threshold, where only long sessions
reach. (Found by the soak: a long session that resumed from a partly cached
prefix computed shared prefix blocks with partial attention.)

The DRE needs the history's keys as vLLM computed them; the CPU cache packs
them per ISA, so each layer keeps a plain mirror of its keys by slot (written
in ``do_kv_cache_update``, allocated only when retrieval is on).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from kvreel.connector.retrieval.retriever import Retriever

SINK_TOKENS = 4
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


class RetrievalAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with the block table of long sequences cut to sink +
    selected + window blocks when retrieval is on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.retriever = Retriever.get()
        self.key_mirror: torch.Tensor | None = None
        self.layer_index: int | None = None

    def _register(self, layer) -> None:
        m = _LAYER_RE.search(getattr(layer, "layer_name", ""))
        self.layer_index = int(m.group(1)) if m else -1
        if self.layer_index >= 0:
            self.retriever.layers[self.layer_index] = self

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if not self.retriever.active or self.attn_type != AttentionType.DECODER:
            return
        if self.layer_index is None:
            self._register(layer)
        if self.key_mirror is None:
            num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
            self.key_mirror = torch.zeros((num_blocks * block_size, num_kv_heads, self.head_size), dtype=key.dtype)
        n = min(slot_mapping.shape[0], key.shape[0])
        slots = slot_mapping[:n]
        valid = slots >= 0
        self.key_mirror.index_copy_(0, slots[valid].long(), key[:n][valid])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is not None and self.key_mirror is not None and self.layer_index is not None \
                and self.layer_index >= 0 and attn_metadata.causal is True \
                and int(attn_metadata.max_seq_len) >= self.retriever.cfg.retrieval_min_tokens:
            attn_metadata = self._retrieval_metadata(layer, query, kv_cache, attn_metadata)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _history_key(self, history: torch.Tensor, block_size: int) -> str:
        """Names a request's history: its block ids and, since freed blocks are
        reused by other requests, the first layer's first key of each block."""
        first = self.retriever.layers[min(self.retriever.layers)].key_mirror
        probe = first[history.long() * block_size].contiguous().view(torch.uint8)
        return f"{zlib.crc32(history.numpy().tobytes()):08x}{zlib.crc32(probe.numpy().tobytes()):08x}-{len(history)}"

    def _retrieval_metadata(self, layer, query, kv_cache, meta):
        """The metadata with long requests' block rows cut to sink + selected + window."""
        cfg = self.retriever.cfg
        block_size = kv_cache.shape[2]
        block_table, seq_lens = meta.block_table, meta.seq_lens
        qsl = meta.query_start_loc.tolist()
        changed = False
        for r, seq_len in enumerate(seq_lens.tolist()):
            q_len = qsl[r + 1] - qsl[r]
            if seq_len - q_len < cfg.retrieval_min_tokens:
                continue        # a query below the threshold: its KV must stay exact (see the module doc)
            sink = -(-SINK_TOKENS // block_size)
            tail = max(0, seq_len - q_len - cfg.retrieval_window) // block_size
            if tail <= sink:
                continue
            row = block_table[r, :-(-seq_len // block_size)]
            history = row[sink:tail]
            slots = (history.long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
            queries = query[qsl[r]:qsl[r + 1]]
            H, G = self.num_kv_heads, self.num_heads // self.num_kv_heads
            queries = queries.reshape(q_len, H, G, -1).permute(1, 0, 2, 3).reshape(H, q_len * G, -1)
            tokens = self.retriever.selection(
                self.layer_index, int(row[0]), functools.cache(lambda n: self._history_key(history[:n], block_size)),
                len(history), queries,
                lambda i, first: self.retriever.layers[i].key_mirror[slots[first * block_size:]].permute(1, 0, 2),
                block_size)
            if tokens is None:
                continue
            keep = torch.zeros(len(history), dtype=torch.bool)
            keep[torch.unique(tokens.long() // block_size).clamp(max=len(history) - 1)] = True
            self.retriever.count("retrieval_history_blocks", len(history))
            self.retriever.count("retrieval_kept_blocks", int(keep.sum()))
            if bool(keep.all()):
                continue
            if not changed:
                block_table, seq_lens, changed = block_table.clone(), seq_lens.clone(), True
            kept = torch.cat([row[:sink], history[keep], row[tail:]])
            block_table[r, :len(kept)] = kept
            seq_lens[r] = seq_len - block_size * int((~keep).sum())
        if not changed:
            return meta
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size, seq_lens=seq_lens, dtype=query.dtype, query_start_loc=meta.query_start_loc,
            causal=meta.causal, sliding_window_size=self.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=meta.dynamic_causal,
            kv_cache_dtype=self.kv_cache_dtype)
        return dataclasses.replace(meta, block_table=block_table, seq_lens=seq_lens,
                                   max_seq_len=int(seq_lens.max()), scheduler_metadata=scheduler_metadata)


class RetrievalCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with retrieval for long sequences."""

    @staticmethod
    def get_impl_cls() -> type[RetrievalAttentionImpl]:
        return RetrievalAttentionImpl
