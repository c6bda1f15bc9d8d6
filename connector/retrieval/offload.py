"""History offload inside vLLM's KV cache manager (the engine-core process).

With retrieval on, kvreel's attention backend reports its layers'
``FullAttentionSpec`` as ``OffloadedHistorySpec`` (``customize_spec``), and
vLLM's KV cache spec registry builds ``HistoryOffloadManager`` for them: vLLM's
full-attention manager, except that a long request's blocks older than its
local window are returned to the block pool once kvreel holds them, the way
vLLM's own sliding-window and R-SWA managers drop blocks outside their window.
The manager learns what kvreel holds from ``LEDGER``, which the connector's
scheduler side (same process) keeps: blocks confirmed in the worker's history
store, or promised to it by an admission whose history kvreel loads itself.
A request never loses a block kvreel does not hold."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvreel.connector.vllm_internals import full_attention_manager, register_kv_cache_spec


class HistoryLedger:
    """Per request: how many leading blocks kvreel's history store holds."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def hold(self, req_id: str, blocks: int) -> None:
        with self._lock:
            self._held[req_id] = blocks

    def held(self, req_id: str) -> int:
        with self._lock:
            return self._held.get(req_id, 0)

    def release(self, req_id: str) -> None:
        with self._lock:
            self._held.pop(req_id, None)


LEDGER = HistoryLedger()


@dataclass(frozen=True, kw_only=True)
class OffloadedHistorySpec(FullAttentionSpec):
    """Full attention whose history beyond ``min_tokens`` lives in kvreel:
    vLLM keeps a long request's last ``window_tokens`` (and the tokens in flight)."""

    window_tokens: int = 0
    min_tokens: int = 0
    in_flight_tokens: int = 0

    def skipped_tokens(self, held_blocks: int, num_computed_tokens: int) -> int:
        if num_computed_tokens < self.min_tokens:
            return 0
        window_start = max(0, num_computed_tokens - self.window_tokens) // self.block_size
        return min(held_blocks, window_start) * self.block_size

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Blocks a request holds at most: everything until it is long, then the
        window plus two steps in flight (the newest step's blocks are released
        once the worker has confirmed they are in kvreel)."""
        tokens = max(self.min_tokens, self.window_tokens + self.block_size) + 2 * max_in_flight_tokens
        return cdiv(min(tokens, max_model_len), self.block_size)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        return self.max_admission_blocks_per_request(self.in_flight_tokens,
                                                     vllm_config.model_config.max_model_len) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list["OffloadedHistorySpec"]) -> "OffloadedHistorySpec":
        base = FullAttentionSpec.merge(specs)
        first = specs[0]
        if any((s.window_tokens, s.min_tokens, s.in_flight_tokens) !=
               (first.window_tokens, first.min_tokens, first.in_flight_tokens) for s in specs):
            raise ValueError("kvreel: all layers of a KV cache group must share one history offload setting")
        fields = {f: getattr(base, f) for f in FullAttentionSpec.__dataclass_fields__}
        return cls(**fields, window_tokens=first.window_tokens, min_tokens=first.min_tokens,
                   in_flight_tokens=first.in_flight_tokens)


class HistoryOffloadManager(full_attention_manager()):
    """vLLM's full-attention manager that frees a long request's blocks below
    its window once kvreel holds them (``LEDGER``)."""

    def __init__(self, kv_cache_spec: OffloadedHistorySpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        # vLLM passes an admission cap only to its own recycling specs
        self.max_admission_blocks_per_request = kv_cache_spec.max_admission_blocks_per_request(
            kv_cache_spec.in_flight_tokens, 1 << 62)
        self._request: str | None = None

    @contextlib.contextmanager
    def _for(self, request_id: str):
        """vLLM asks ``get_num_skipped_tokens`` without a request; the calls that
        lead to it have one, so it is noted here for the duration."""
        outer, self._request = self._request, request_id
        try:
            yield
        finally:
            self._request = outer

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        if self._request is None:
            return 0
        return self.kv_cache_spec.skipped_tokens(LEDGER.held(self._request), num_computed_tokens)

    def get_num_blocks_to_allocate(self, request_id: str, *args, **kwargs) -> int:
        with self._for(request_id):
            return super().get_num_blocks_to_allocate(request_id, *args, **kwargs)

    def add_local_computed_blocks(self, request_id: str, *args, **kwargs) -> None:
        with self._for(request_id):
            super().add_local_computed_blocks(request_id, *args, **kwargs)

    def allocate_external_computed_blocks(self, request_id: str, *args, **kwargs) -> None:
        with self._for(request_id):
            super().allocate_external_computed_blocks(request_id, *args, **kwargs)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        with self._for(request_id):
            super().remove_skipped_blocks(request_id, processed_computed_tokens)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        LEDGER.release(request_id)      # preempted or finished: a new admission holds anew


def register() -> None:
    """Make vLLM build ``HistoryOffloadManager`` for ``OffloadedHistorySpec`` groups."""
    register_kv_cache_spec(OffloadedHistorySpec, HistoryOffloadManager, FullAttentionSpec)


def offloaded_spec(spec: FullAttentionSpec, window_tokens: int, min_tokens: int,
                   in_flight_tokens: int) -> OffloadedHistorySpec:
    fields = {f: getattr(spec, f) for f in FullAttentionSpec.__dataclass_fields__}
    return OffloadedHistorySpec(**fields, window_tokens=window_tokens, min_tokens=min_tokens,
                                in_flight_tokens=in_flight_tokens)


__all__ = ["LEDGER", "HistoryLedger", "HistoryOffloadManager", "OffloadedHistorySpec", "offloaded_spec", "register"]
