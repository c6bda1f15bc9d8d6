"""``KVReelConnector``: the class vLLM loads through
``{"kv_connector": "KVReelConnector", "kv_connector_module_path": "kvreel.connector"}``.

It only routes vLLM's hooks to the scheduler side (``scheduler_side``) or the
worker side (``worker_side``), like vLLM's own connectors.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvreel.connector.worker_side.block_copy import copied_groups, layout_of
from kvreel.connector.config import KVReelConfig
from kvreel.connector.metadata import KVReelMetadata
from kvreel.connector.stats import KVReelPromMetrics, KVReelStats
from kvreel.connector.tiers import Tier
from kvreel.connector.vllm_internals import check_version, cpu_attn_isa, kv_transfer_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def _share_vllm_log_handlers() -> None:
    """kvreel's modules log to "kvreel.*" (no vLLM import needed); inside vLLM
    those lines go wherever vLLM's own go, in its format."""
    root = logging.getLogger("kvreel")
    vllm_logger = logging.getLogger("vllm")
    if vllm_logger.handlers and not root.handlers:
        for handler in vllm_logger.handlers:
            root.addHandler(handler)
        root.setLevel(vllm_logger.level or logging.INFO)
        root.propagate = False


_share_vllm_log_handlers()

FORMAT_VERSION = 1


def identity_fields(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> dict:
    """Everything that makes a stored page meaningful: the model and its
    architecture, dtypes, page layout and parallel shape."""
    regions, block_bytes = layout_of(kv_cache_config)
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    fields = {
        "format": FORMAT_VERSION,
        "model": mc.model,
        "revision": mc.revision,
        "hf_config": hashlib.sha256(mc.hf_config.to_json_string(use_diff=False).encode()).hexdigest(),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": spec.block_size,
        "layout": getattr(kv_cache_config, "kv_cache_layout", None),
        "regions": regions,
        "block_bytes": block_bytes,
        "tp": pc.tensor_parallel_size,
        "pp": pc.pipeline_parallel_size,
        "hash": cc.prefix_caching_hash_algo,
    }
    return json.loads(json.dumps(fields, default=str))


def model_identity(fields: dict) -> str:
    """A short digest of ``identity_fields``: chunks of another identity are never loaded."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


# KV cache specs whose pages kvreel copies by block position: attention KV, whole
# (full attention) or the part a window still holds (NULL_BLOCK elsewhere).
COPIED_SPECS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)


def check_kv_cache_groups(kv_cache_config: "KVCacheConfig", cfg: KVReelConfig) -> int:
    """The block size of the model's KV cache groups, once kvreel knows it can
    serve them exactly; a model it cannot is refused here, at start-up, with
    the reason (a prefix restored without some of its state gives wrong tokens)."""
    groups = kv_cache_config.kv_cache_groups
    copied = copied_groups(kv_cache_config)
    transferable = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    sizes = set()
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        kinds = "/".join(sorted({type(s).__name__ for s in specs}))
        where = f"KV cache group {g} ({kinds}, layers {', '.join(group.layer_names[:3])}" \
                f"{', ...' if len(group.layer_names) > 3 else ''})"
        if g in transferable and g not in copied:
            raise ValueError(f"kvreel restores prefixes by vLLM's block hashes, and {where} cannot be restored "
                             "that way; serve this model without kvreel")
        if g not in copied:
            continue
        if not all(isinstance(s, COPIED_SPECS) for s in specs):
            raise ValueError(f"kvreel saves attention KV pages only, and {where} holds state it does not save "
                             "(e.g. recurrent layers); a prefix restored without it would give wrong tokens: "
                             "serve this model without kvreel")
        sizes.add(spec.block_size)
    if len(sizes) > 1:
        raise ValueError(f"kvreel needs one block size for all KV cache groups (this model has {sorted(sizes)})")
    if len(groups) > 1 and cfg.retrieval != "off":
        raise ValueError(f"KVREEL_RETRIEVAL needs a model whose layers share one full-attention KV cache group "
                         f"(this one has {len(groups)}): set KVREEL_RETRIEVAL=off")
    if len(groups) > 1 and cfg.fetch_mode == "blocking":
        # a load inside the forward pass can only report failed block ids, which vLLM cannot
        # map back to requests with several groups
        raise ValueError(f"KVREEL_FETCH_MODE=blocking needs a model with one KV cache group "
                         f"(this one has {len(groups)}): set KVREEL_FETCH_MODE=async")
    block_size = sizes.pop()
    if kv_cache_config.hash_block_size not in (None, block_size):
        raise ValueError(f"kvreel needs hash_block_size == block_size ({kv_cache_config.hash_block_size} "
                         f"!= {block_size})")
    return block_size


def kv_events_enabled(vllm_config: "VllmConfig") -> bool:
    """vLLM publishes KV cache events (``--kv-events-config``): kvreel's tiers join them."""
    events = vllm_config.kv_events_config
    return bool(events is not None and events.enable_kv_cache_events)


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group
        return get_world_group().rank_in_group
    except (ImportError, AssertionError, AttributeError):
        return 0


class KVReelConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered, exact KV offload (host memory -> disk) keyed by vLLM's block hashes.

    Supports vLLM's hybrid KV cache manager (``SupportsHMA``): a model with
    sliding-window layers keeps only their window in vLLM's cache, and kvreel
    stores and restores each KV cache group's pages with its own block ids."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, not an error

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        check_version()
        transfer = kv_transfer_config(self)
        extra = dict(transfer.kv_connector_extra_config or {})
        self.cfg = KVReelConfig.load(overrides=extra)
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("kvreel keys chunks by vLLM's prefix-cache block hashes: "
                             "start vLLM with prefix caching enabled (the default)")
        block_size = check_kv_cache_groups(kv_cache_config, self.cfg)
        if transfer.kv_load_failure_policy != "recompute":
            # A failed or damaged load must cost a recompute, never the request.
            logger.info("kvreel: setting kv_load_failure_policy='recompute'")
            transfer.kv_load_failure_policy = "recompute"
        fields = identity_fields(vllm_config, kv_cache_config)
        self.identity = model_identity(fields)
        self.kv_cache_config = kv_cache_config
        self.max_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvreel.scheduler.kvreel_scheduler import KVReelScheduler
            regions, block_bytes = layout_of(kv_cache_config)
            history_bytes = None
            if self.cfg.retrieval != "off":           # one full-attention group (check_kv_cache_groups)
                from kvreel.connector.retrieval.history import history_bytes_per_block
                from kvreel.connector.retrieval.page_packing import PagePacking
                spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
                packing = PagePacking(block_size, spec.head_size, spec.dtype,
                                      cpu_attn_isa(spec.dtype, block_size, spec.head_size))
                history_bytes = history_bytes_per_block(regions * block_bytes, packing)
            self._scheduler = KVReelScheduler(self.cfg, self.identity, block_size, regions * block_bytes,
                                              workers=vllm_config.parallel_config.world_size,
                                              groups=len(kv_cache_config.kv_cache_groups),
                                              kv_events=kv_events_enabled(vllm_config),
                                              history_bytes_per_block=history_bytes)
        else:
            from kvreel.connector.worker_side.worker import KVReelWorker
            self._worker = KVReelWorker(self.cfg, self.identity, _worker_rank(), fields)

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches, self.kv_cache_config, self.max_batched_tokens)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)       # before the forward pass (loads may start after it)

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            assert isinstance(connector_metadata, KVReelMetadata)
            self._worker.before_writes(connector_metadata)     # before the step writes any block

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVReelMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv (host) or before the request is released (disk)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole pages of all layers are copied once, in wait_for_save

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVReelMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]):
        _, done, _ = self._worker.get_finished(finished_req_ids)
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, done, failed = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.take_worker_meta() if self._worker else None

    def get_kv_connector_stats(self):
        side = self._worker or self._scheduler
        return side.take_stats() if side is not None else None

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        if num_external_tokens == 0:
            return {}
        tokens = self._scheduler.planned_tokens_by_tier(request.request_id)
        if not tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {CacheHitSource.HOST if tier == Tier.HOST else CacheHitSource.DISK: n for tier, n in tokens.items()}

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def take_events(self):
        return self._scheduler.take_events()

    def request_finished(self, request, block_ids):
        self._scheduler.request_finished(request)
        return False, None       # a step's saves are copied before vLLM writes their blocks again: nothing to wait for

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset() if self._scheduler else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVReelStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVReelPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = ["KVReelConnector", "check_kv_cache_groups", "identity_fields", "model_identity"]
