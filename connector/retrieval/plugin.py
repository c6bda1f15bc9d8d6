"""kvreel's ``vllm.general_plugins`` entry point: with ``KVREEL_RETRIEVAL`` on,
vLLM's CPU attention backend is replaced by kvreel's retrieval backend, and
vLLM's KV cache manager learns kvreel's offloaded-history spec, in every vLLM
process, so the env var is all a user sets."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def register() -> None:
    if os.environ.get("KVREEL_RETRIEVAL", "off") == "off":
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvreel.connector.config import KVReelConfig
    KVReelConfig.load()          # a bad KVREEL_* value stops start-up here, with its message
    if not current_platform.is_cpu():
        logger.warning("kvreel: KVREEL_RETRIEVAL is implemented for vLLM's CPU backend only; "
                       "this platform keeps full attention")
        return
    from kvreel.connector.retrieval import offload
    offload.register()
    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "kvreel.connector.retrieval.attention_backend.RetrievalCPUAttentionBackend")
