import os
from pathlib import Path

import pytest

from kvreel.connector.config import ConfigError, KVReelConfig, parse_bytes, settings_table_markdown


def test_defaults_and_sizes():
    cfg = KVReelConfig.load(env={})
    assert cfg.disk_dir is None and cfg.chunk_tokens == 256
    cfg = KVReelConfig.load(env={"KVREEL_CPU_BYTES": "512MiB", "KVREEL_DISK_DIR": "/x", "KVREEL_DISK_BYTES": "8GiB"})
    assert (cfg.cpu_bytes, cfg.disk_dir, cfg.disk_bytes) == (512 * 2**20, "/x", 8 * 2**30)
    assert [parse_bytes(s) for s in ("1000", "1.5GB", "2k", "3 TiB")] == [1000, 1_500_000_000, 2000, 3 * 2**40]


def test_extra_config_overrides_env():
    cfg = KVReelConfig.load(env={"KVREEL_CPU_BYTES": "1GiB"},
                            overrides={"cpu_bytes": "2GiB", "KVREEL_CHUNK_TOKENS": 512})
    assert cfg.cpu_bytes == 2 * 2**30 and cfg.chunk_tokens == 512


@pytest.mark.parametrize("env,message", [
    ({"KVREEL_CPU_BYTES": "lots"}, "KVREEL_CPU_BYTES='lots' is invalid: expected a size >= 0B"),
    ({"KVREEL_CHUNK_TOKENS": "8"}, "KVREEL_CHUNK_TOKENS='8' is invalid: expected an integer in [16, 1048576]"),
    ({"KVREEL_DISK_BYTES": "1KiB"}, "KVREEL_DISK_BYTES='1KiB' is invalid: expected a size >= 1.0MiB"),
    ({"KVREEL_CPU_BYTE": "1GiB"}, "unknown kvreel setting 'KVREEL_CPU_BYTE'; did you mean KVREEL_CPU_BYTES?"),
    ({"KVREEL_DSK_DIR": "/x"}, "did you mean KVREEL_DISK_DIR?"),
    ({"KVREEL_REMOTE_FORMS": "zstd,video"}, "expected a comma list of raw, zstd, video that includes raw"),
    ({"KVREEL_REMOTE_FORMS": "raw,h264"}, "KVREEL_REMOTE_FORMS='raw,h264' is invalid"),
    ({"KVREEL_REMOTE_RESOLUTIONS": "64"}, "expected a comma list of frame sides in [144, 4096]"),
    ({"KVREEL_REMOTE_QUANT": "int8"}, "KVREEL_REMOTE_QUANT='int8' quantizes the video form: add video to"),
    ({"KVREEL_FETCH_FORM": "video@256"}, "KVREEL_FETCH_FORM='video@256' is not a stored form"),
    ({"KVREEL_REMOTE_FORMS": "raw,video", "KVREEL_FETCH_FORM": "video@300"}, "is not a stored resolution"),
    ({"KVREEL_FETCH_POLICY": "lifo"}, "expected fair or fcfs"),
    ({"KVREEL_FETCH_MODE": "sync"}, "expected async or blocking"),
    ({"KVREEL_DISK_DIR": "/etc/hostname"}, "KVREEL_DISK_DIR='/etc/hostname' is invalid: expected a writable directory"),
    ({"KVREEL_DRE_ADDRESS": "localhost"}, "KVREEL_DRE_ADDRESS='localhost' is invalid: expected a Unix-socket path"),
    ({"KVREEL_DRE_ADDRESS": "127.0.0.1:99999"}, "KVREEL_DRE_ADDRESS='127.0.0.1:99999' is invalid"),
    ({"KVREEL_DRE_ADDRESS": "/tmp"}, "KVREEL_DRE_ADDRESS='/tmp' is invalid"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ConfigError) as err:
        KVReelConfig.load(env=env)
    assert message in str(err.value)


def test_paths_and_addresses_that_parse():
    cfg = KVReelConfig.load(env={"KVREEL_DISK_DIR": "/var/cache/kvreel-not-yet", "KVREEL_DRE_ADDRESS": "[::1]:7070"})
    assert (cfg.disk_dir, cfg.dre_address) == ("/var/cache/kvreel-not-yet", "[::1]:7070")
    assert KVReelConfig.load(env={"KVREEL_DRE_ADDRESS": "/run/kvreel/dre.sock"}).dre_address == "/run/kvreel/dre.sock"


def test_remote_forms_parse():
    cfg = KVReelConfig.load(env={"KVREEL_REMOTE_FORMS": " raw , video,zstd,video", "KVREEL_REMOTE_QUANT": "int8",
                                 "KVREEL_REMOTE_RESOLUTIONS": "512,256", "KVREEL_FETCH_FORM": "video@512"})
    assert cfg.remote_forms == ("raw", "video", "zstd") and cfg.remote_resolutions == (256, 512)
    assert (cfg.remote_quant, cfg.fetch_form, cfg.fetch_policy, cfg.fetch_mode) == ("int8", "video@512", "fair",
                                                                                     "async")


def test_unknown_extra_config_key():
    with pytest.raises(ConfigError, match="did you mean KVREEL_CHUNK_TOKENS"):
        KVReelConfig.load(env={}, overrides={"chunk_token": 64})


def test_configuration_reference_documents_every_setting():
    reference = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    assert settings_table_markdown() in reference


@pytest.mark.parametrize("env, message", [
    ({"KVREEL_REMOTE_URL": "redis://127.0.0.1:6379/0"},
     "KVREEL_REMOTE_URL=redis://... needs the Python package 'redis', which is not installed"),
    ({"KVREEL_REMOTE_URL": "file:///tmp/x", "KVREEL_REMOTE_FORMS": "raw,video"},
     "KVREEL_REMOTE_FORMS=raw,video needs the Python package 'av', which is not installed"),
])
def test_a_feature_whose_package_is_missing_stops_startup_with_one_line(env, message):
    """Python's own way to make a module unimportable (None in sys.modules), as if it were uninstalled."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['redis'] = sys.modules['av'] = None\n"
            "from kvreel.connector.config import KVReelConfig, ConfigError\n"
            "import os\n"
            "try:\n    KVReelConfig.load()\nexcept ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(message)
    assert len(out.stdout.strip().splitlines()) == 1


def test_a_server_given_a_bad_setting_stops_before_loading_anything(monkeypatch, capsys):
    """kvreel's vLLM plugin reads the server's command line: with kvreel's
    connector on it, a bad KVREEL_* value is one line and exit 2, before vLLM
    builds its parser or loads a model."""
    from kvreel.connector.retrieval.plugin import check_command_line
    ours = '{"kv_connector":"KVReelConnector","kv_connector_module_path":"kvreel.connector","kv_role":"kv_both"}'
    monkeypatch.setenv("KVREEL_CPU_BYTES", "lots")
    with pytest.raises(SystemExit) as stop:
        check_command_line(["vllm", "serve", "m", "--kv-transfer-config", ours])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvreel: KVREEL_CPU_BYTES='lots' is invalid: expected a size >= 0B such as 512MiB, 8GiB or 1000000"]
    check_command_line(["vllm", "serve", "m", "--kv-transfer-config", ours.replace("KVReel", "Example")])
    monkeypatch.setenv("KVREEL_CPU_BYTES", "1GiB")
    check_command_line(["vllm", "serve", "m", f"--kv-transfer-config={ours}"])
    bad_extra = ours[:-1] + ',"kv_connector_extra_config":{"disk_bytes":"-1"}}'
    with pytest.raises(SystemExit):
        check_command_line(["vllm", "serve", "m", "--kv-transfer-config", bad_extra])


def test_vllms_own_server_refuses_a_bad_setting_in_one_line(tmp_path):
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    env["KVREEL_CPU_BYTES"] = "lots"
    out = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
                          "--kv-transfer-config", '{"kv_connector":"KVReelConnector",'
                          '"kv_connector_module_path":"kvreel.connector","kv_role":"kv_both"}'],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("kvreel: KVREEL_CPU_BYTES='lots' is invalid")
    assert "Traceback" not in out.stderr + out.stdout


def test_every_config_field_has_the_type_its_parser_returns():
    import dataclasses
    from typing import Any
    types = {f.name: f.type for f in dataclasses.fields(KVReelConfig)}
    assert Any not in types.values()
    assert types["cpu_bytes"] is int and types["retrieval_alpha"] is float and types["remote_forms"] == tuple[str, ...]
    defaults = dataclasses.asdict(KVReelConfig.load(env={}))
    assert all(isinstance(defaults[name], t) for name, t in types.items() if isinstance(t, type))
