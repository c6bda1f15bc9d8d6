"""kvreel's ``vllm.general_plugins`` entry point, run in every vLLM process.

A server whose command line attaches kvreel's connector is checked first: a
bad ``KVREEL_*`` value stops it before anything loads (``check_command_line``).
On vLLM's CPU platform it gives an engine with kvreel's connector the
threads plain vLLM's engine gets (``keep_plain_cpu_split``: the same bits),
puts kvreel's retrieval backend in place of ``CPU_ATTN`` and teaches vLLM's
KV cache manager kvreel's offloaded-history spec. The backend is vLLM's own,
unchanged, unless the engine being built has kvreel's connector with
retrieval on (``engine_settings``): the plugin runs
before any engine's configuration is known, and only then do settings given
in ``kv_connector_extra_config`` reach the attention layers as the
environment's do."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
CONNECTOR = "KVReelConnector"


def register() -> None:
    check_command_line()
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        if retrieval_asked():
            logger.warning("kvreel: KVREEL_RETRIEVAL is implemented for vLLM's CPU backend only; "
                           "this platform keeps full attention")
        return
    from kvreel.connector.retrieval import offload
    from kvreel.connector.vllm_internals import keep_plain_cpu_split, register_cpu_attention, version_problem
    if version_problem():          # the connector refuses to start and says why; vLLM's attention stays vLLM's
        return
    keep_plain_cpu_split(attaches_kvreel)
    offload.register()
    register_cpu_attention("kvreel.connector.retrieval.attention_backend.RetrievalCPUAttentionBackend")


def transfer_config(argv: list[str]) -> dict | None:
    """The ``--kv-transfer-config`` a command line gives (its last, as vLLM's
    parser takes it), parsed; None when it gives none. ValueError when it is
    not a JSON object."""
    import json
    text = None
    for i, arg in enumerate(argv):
        if arg.startswith("--kv-transfer-config="):
            text = arg.partition("=")[2]
        elif arg == "--kv-transfer-config" and i + 1 < len(argv):
            text = argv[i + 1]
    if text is None:
        return None
    try:
        transfer = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--kv-transfer-config is not JSON ({e})") from None
    if not isinstance(transfer, dict):
        raise ValueError("--kv-transfer-config is not a JSON object")
    return transfer


def settings_problem(transfer: dict) -> str | None:
    """What stops kvreel's connector with this transfer config here: a bad
    ``KVREEL_*`` value (environment, then ``kv_connector_extra_config``) or an
    unsupported vLLM; None when nothing does. Imports no part of vLLM."""
    from kvreel.connector.config import ConfigError, KVReelConfig
    from kvreel.connector.vllm_internals import version_problem
    try:
        KVReelConfig.load(overrides=transfer.get("kv_connector_extra_config") or {})
    except ConfigError as e:
        return str(e)
    return version_problem()


def check_command_line(argv: list[str] | None = None) -> None:
    """A server started with kvreel's connector on its command line (``vllm serve
    ... --kv-transfer-config '{"kv_connector":"KVReelConnector",...}'``) stops
    here, before vLLM loads anything, with one line naming a bad ``KVREEL_*``
    value or an unsupported vLLM (vLLM loads its plugins while it builds its
    argument parser; ``kvreel serve`` checks the same before vLLM is imported)."""
    import sys
    try:
        transfer = transfer_config(sys.argv if argv is None else argv)
    except ValueError:
        return                                          # vLLM says what is wrong with it
    if transfer is None or transfer.get("kv_connector") != CONNECTOR:
        return
    problem = settings_problem(transfer)
    if problem:
        print(f"kvreel: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def retrieval_asked() -> bool:
    """Whether the environment asks for retrieval, for a warning where kvreel's
    settings are not loaded (an engine without kvreel's connector, another
    platform); where they are, ``engine_settings`` reads them all."""
    return os.environ.get("KVREEL_RETRIEVAL", "off") != "off"


def attaches_kvreel(vllm_config) -> bool:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return kv is not None and kv.kv_connector == CONNECTOR


def engine_settings(vllm_config):
    """kvreel's settings for this engine (``KVREEL_*``, then its connector's
    ``kv_connector_extra_config``) when it attaches kvreel's connector with
    retrieval on; None otherwise, and vLLM's attention stays vLLM's."""
    from kvreel.connector.config import KVReelConfig
    if not attaches_kvreel(vllm_config):
        if retrieval_asked():
            logger.error("kvreel: KVREEL_RETRIEVAL needs kvreel's connector (--kv-transfer-config "
                         "'{\"kv_connector\":\"KVReelConnector\",\"kv_connector_module_path\":\"kvreel.connector\","
                         "\"kv_role\":\"kv_both\"}'); attention stays full")
        return None
    cfg = KVReelConfig.load(overrides=dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))
    return cfg if cfg.retrieval != "off" else None
