"""Connector statistics: counters that travel worker -> scheduler -> logger and
are exported to Prometheus through vLLM's connector metrics hooks.

Features outside the connector's core (retrieval attention) count in their
own ``KVReelStats`` and hand them over through ``register_stats_source``, so
the connector exports them without importing the feature."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvreel.connector.tiers import Tier
from kvreel.connector.vllm_internals import connector_counter

# counter name -> (Prometheus name, help, label names)
COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "lookup_hit_blocks": ("vllm:kvreel_lookup_hit_blocks_total", "Blocks found by prefix lookups, by tier", ("tier",)),
    "lookup_miss_blocks": ("vllm:kvreel_lookup_miss_blocks_total", "Prompt blocks not held in any tier", ()),
    "loaded_bytes": ("vllm:kvreel_loaded_bytes_total", "Bytes restored into the paged KV cache, by tier", ("tier",)),
    "saved_bytes": ("vllm:kvreel_saved_bytes_total", "Bytes saved into a tier", ("tier",)),
    "load_seconds": ("vllm:kvreel_load_seconds_total", "Time spent restoring chunks, by tier", ("tier",)),
    "load_count": ("vllm:kvreel_loads_total", "Chunk pieces restored, by tier", ("tier",)),
    "save_seconds": ("vllm:kvreel_save_seconds_total", "Time spent copying blocks out of the paged cache", ()),
    "save_count": ("vllm:kvreel_saves_total", "Chunks copied out of the paged cache", ()),
    "evicted_chunks": ("vllm:kvreel_evicted_chunks_total", "Chunks evicted, by tier", ("tier",)),
    "corrupt_chunks": ("vllm:kvreel_corrupt_chunks_total", "Damaged, truncated or foreign chunks rejected", ("tier",)),
    "load_errors": ("vllm:kvreel_load_error_blocks_total", "Blocks reported to vLLM as failed loads (recomputed)", ()),
    "disk_write_failures": ("vllm:kvreel_disk_write_failures_total", "Chunk writes that did not reach the disk", ()),
    "remote_fetches": ("vllm:kvreel_remote_fetches_total", "Remote chunks fetched, by stored form", ("form",)),
    "remote_fetch_bytes": ("vllm:kvreel_remote_fetch_bytes_total", "Bytes fetched from the remote store, by form",
                           ("form",)),
    "remote_upload_failures": ("vllm:kvreel_remote_upload_failures_total",
                               "Chunks the remote uploader failed to store or dropped (queue full)", ()),
    "encode_seconds": ("vllm:kvreel_encode_seconds_total",
                       "Time the uploader spent producing each stored form (raw file, zstd, video per resolution)",
                       ("form",)),
    "remote_transfer_seconds": ("vllm:kvreel_remote_transfer_seconds_total",
                                "Time spent moving remote chunks over the link, by form", ("form",)),
    "decode_seconds": ("vllm:kvreel_decode_seconds_total",
                       "Time spent decoding and verifying fetched chunks (NVDEC or CPU), by form", ("form",)),
    "prefetches": ("vllm:kvreel_prefetch_chunks_total",
                   "Workflow prefetches of chunks from disk into the host tier, by result: issued, used (loaded "
                   "by a request), wasted (evicted unused), failed", ("result",)),
    "retrieval_steps": ("vllm:kvreel_retrieval_steps_total",
                        "Attention calls of long sequences, by outcome: exact (all history kept), whole (a prefill "
                        "chunk over a history too short to narrow attended to all of it), selected, or "
                        "selected while the DRE was down (tokens it has not clustered are all scored)",
                        ("outcome",)),
    "retrieval_history_blocks": ("vllm:kvreel_retrieval_history_blocks_total",
                                 "History blocks (between sinks and window) seen by retrieval attention", ()),
    "retrieval_kept_blocks": ("vllm:kvreel_retrieval_kept_blocks_total",
                              "History blocks retrieval attention selected and attended to", ()),
    "retrieval_scored_tokens": ("vllm:kvreel_retrieval_scored_tokens_total",
                                "History tokens of long sequences' attention calls, by how a call ranked them: "
                                "keys (each key scored with the call's queries), or passed over without a score "
                                "by the DRE's clusters or by the blocks' key bounds", ("by",)),
    "dre_restarts": ("vllm:kvreel_dre_restarts_total", "Times the DRE service was found dead and restarted", ()),
    "dre_tables": ("vllm:kvreel_dre_tables_total",
                   "History tables sent to the DRE, by how: clustered anew, or extended with a growing "
                   "session's new blocks", ("how",)),
}

# label values exported at zero from start-up, so a dashboard (or a person
# reading /metrics) finds the series before the first event
KNOWN_LABEL_VALUES = {"tier": tuple(t.value for t in Tier),
                      "outcome": ("exact", "whole", "selected", "dre_down"),
                      "how": ("clustered", "extended"),
                      "by": ("keys", "clusters", "bounds"),
                      "result": ("issued", "used", "wasted", "failed")}


@dataclass
class KVReelStats(KVConnectorStats):
    """``data`` maps "name" or "name|label" to a summed number."""

    def reset(self):
        self.data = {}

    def add(self, name: str, value: float = 1, label: str | None = None) -> None:
        assert name in COUNTERS, name
        key = f"{name}|{label}" if label else name
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> "KVReelStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not self.data

    def take(self) -> "KVReelStats | None":
        """Hand over the counts collected so far and start afresh."""
        if not self.data:
            return None
        out = KVReelStats(data=self.data)
        self.data = {}
        return out


_sources: list[Callable[[], "KVReelStats | None"]] = []
_sources_lock = threading.Lock()


def register_stats_source(take: Callable[[], "KVReelStats | None"]) -> None:
    """``take()`` hands over a feature's counts since its last call; the worker
    side of the connector collects them with its own (once per process)."""
    with _sources_lock:
        if take not in _sources:
            _sources.append(take)


def collect_registered_stats() -> list[KVReelStats]:
    with _sources_lock:
        sources = list(_sources)
    return [s for s in (take() for take in sources) if s is not None]


class KVReelPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: connector_counter(self, prom, doc, labels)
            for name, (prom, doc, labels) in COUNTERS.items()
        }
        for name, (_, _, labels) in COUNTERS.items():
            label_sets = [(v,) for v in KNOWN_LABEL_VALUES.get(labels[0], ())] if labels else [()]
            for engine_values in self.per_engine_labelvalues.values():
                for extra in label_sets:
                    self._counters[name].labels(*map(str, engine_values), *extra)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        base = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for key, value in transfer_stats_data.items():
            name, _, label = key.partition("|")
            counter = self._counters.get(name)
            if counter is not None and value:
                counter.labels(*base, *([label] if label else [])).inc(value)
