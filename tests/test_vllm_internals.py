"""The one door to vLLM's internals: the release range kvreel supports is checked
at start-up and by ``kvreel doctor``; settings from ``kv_connector_extra_config``
reach the attention layers as the environment's do."""

from __future__ import annotations

import pytest

from kvreel.connector.vllm_internals import UnsupportedVLLM, check_version, layer_index, version_problem


@pytest.mark.parametrize("found", ["0.32.0", "0.32.1", "0.32.0+cpu"])
def test_the_supported_series_is_accepted(found):
    assert version_problem(found) is None


@pytest.mark.parametrize("found", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_other_releases_are_refused_with_the_supported_range(found):
    problem = version_problem(found)
    assert problem is not None and "supports vLLM 0.32.x" in problem and found in problem


def test_the_installed_vllm_is_supported_and_the_check_raises_otherwise(monkeypatch):
    check_version()
    import kvreel.connector.vllm_internals as internals
    monkeypatch.setattr(internals, "vllm_version", lambda: "0.40.1")
    with pytest.raises(UnsupportedVLLM, match="this is vLLM 0.40.1"):
        internals.check_version()


def test_layer_numbers_come_from_vllms_layer_names():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("lm_head") is None


def test_retrieval_settings_reach_the_attention_layers_from_the_extra_config(monkeypatch):
    from vllm.config import KVTransferConfig, VllmConfig

    from kvreel.connector.retrieval.plugin import engine_settings
    monkeypatch.delenv("KVREEL_RETRIEVAL", raising=False)

    def engine(extra=None, connector="KVReelConnector"):
        path = "kvreel.connector" if connector == "KVReelConnector" else None
        return VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_connector_module_path=path,
                                                              kv_role="kv_both", kv_connector_extra_config=extra or {}))
    got = engine_settings(engine({"retrieval": "mosaic", "retrieval_budget_share": "0.25"}))
    assert got.retrieval == "mosaic" and got.retrieval_budget_share == 0.25
    assert engine_settings(engine()) is None                               # kvreel without retrieval
    assert engine_settings(engine({"retrieval": "resv"}, connector="ExampleConnector")) is None
    monkeypatch.setenv("KVREEL_RETRIEVAL", "resv")
    assert engine_settings(engine()).retrieval == "resv"                   # the environment, as before


def test_an_engine_with_kvreel_computes_on_the_cpus_plain_vllm_computes_on(monkeypatch):
    """vLLM keeps one core more back for any KV connector (ExampleConnector shows
    it); kvreel's keeps plain vLLM's split (other thread counts give other bf16
    bits), unless VLLM_CPU_NUM_OF_RESERVED_CPU says otherwise."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    from kvreel.connector.retrieval.plugin import attaches_kvreel
    from kvreel.connector.vllm_internals import keep_plain_cpu_split
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")

    def split(connector=None):
        transfer = connector and KVTransferConfig(
            kv_connector=connector, kv_role="kv_both",
            kv_connector_module_path="kvreel.connector" if connector == "KVReelConnector" else None)
        m = OMPProcessManager(VllmConfig(kv_transfer_config=transfer))
        return m.reserve_cpu_num, m.cpu_lists, m.reserved_cpu_list
    keep_plain_cpu_split(attaches_kvreel)
    keep_plain_cpu_split(attaches_kvreel)                  # installed once however often the plugin runs
    plain = split()
    assert split("ExampleConnector")[0] == plain[0] + 1
    assert split("KVReelConnector") == plain
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", str(plain[0] + 1))
    assert split("KVReelConnector")[0] == plain[0] + 1
