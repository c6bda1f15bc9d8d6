"""The kvreel command: doctor and inspect on real files and a real Redis."""

import os
import subprocess
import sys

import pytest
import torch

from kvreel.codec import encode_chunk
from kvreel.connector.tiers.disk import DiskTier


def kvreel(*args, env=None):
    """``kvreel ARGS`` in a fresh process; 600 s as for the demo: ``publish`` starts a
    vLLM engine (82 s on an AVX2-only 2-core CPU, past 120 s with another engine beside it)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    return subprocess.run([sys.executable, "-m", "kvreel.cli.main", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=600)


def test_doctor_reports_tiers_and_refuses_bad_settings(tmp_path, redis_server):
    _, port = redis_server
    ok = kvreel("doctor", env={"KVREEL_DISK_DIR": str(tmp_path / "d"),
                               "KVREEL_REMOTE_URL": f"redis://:s3cret@127.0.0.1:{port}/0"})
    assert ok.returncode == 0, ok.stderr
    assert "settings" in ok.stdout and "valid" in ok.stdout
    assert f"{tmp_path}/d missing; kvreel will create it" in ok.stdout
    assert not (tmp_path / "d").exists()                  # doctor creates nothing
    (tmp_path / "d").mkdir()
    ok = kvreel("doctor", env={"KVREEL_DISK_DIR": str(tmp_path / "d"),
                               "KVREEL_REMOTE_URL": f"redis://:s3cret@127.0.0.1:{port}/0"})
    assert f"{tmp_path}/d writable" in ok.stdout
    assert f"redis://:***@127.0.0.1:{port}/0 reachable" in ok.stdout
    assert "encoder libx265 (lossless HEVC)  available" in ok.stdout
    assert "retrieval attention" in ok.stdout and "off (KVREEL_RETRIEVAL=off)" in ok.stdout
    dead = kvreel("doctor", env={"KVREEL_RETRIEVAL": "resv", "KVREEL_DRE_ADDRESS": str(tmp_path / "no.sock")})
    assert dead.returncode == 1 and f"DRE at {tmp_path}/no.sock UNREACHABLE" in dead.stdout
    gone = kvreel("doctor", env={"KVREEL_REMOTE_URL": "redis://127.0.0.1:1/0", "KVREEL_REMOTE_TIMEOUT_S": "0.5"})
    assert gone.returncode == 1 and "remote tier" in gone.stdout and "UNREACHABLE" in gone.stdout
    bad = kvreel("doctor", env={"KVREEL_CPU_BYTE": "1GiB", "KVREEL_REMOTE_URL": "redis://127.0.0.1:1/0"})
    assert bad.returncode == 1
    assert "did you mean KVREEL_CPU_BYTES?" in bad.stdout


def test_inspect_says_what_a_chunk_and_a_disk_tier_hold(tmp_path):
    import json
    kv = torch.randn(2, 2, 40, 2, 64).to(torch.bfloat16)
    path = tmp_path / "c.kvrc"
    path.write_bytes(encode_chunk(kv, resolutions=(144,)))
    out = kvreel("inspect", str(path))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["container"], info["tokens"], info["dtype"]) == ("codec", 40, "bfloat16")
    assert info["form"] == "video (lossless HEVC)" and info["resolutions"][0]["resolution"] == 144
    disk = tmp_path / "disk"
    tier = DiskTier(disk, "model-x", 0, queue_size=2,
                    description={"model": "/models/tiny", "dtype": "torch.bfloat16", "block_size": 32})
    tier.put(b"\x07" * 32, [b"\x01" * 32, b"\x02" * 32], torch.zeros(1, 2, 64, dtype=torch.uint8))
    tier.flush()
    tier.close()
    out = kvreel("inspect", str(tier.path(b"\x07" * 32)))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["model"], info["tokens"], info["blocks"], info["identity"]) == ("/models/tiny", 64, 2, "model-x")
    assert info["form"].startswith("raw")
    out = kvreel("inspect", str(disk))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["identities"]["model-x"]["model"] == "/models/tiny"
    assert json.loads(out.stdout)["identities"]["model-x"]["chunks"] == 1
    for junk in (b"hello world", b"ab", b""):
        (tmp_path / "junk").write_bytes(junk)
        bad = kvreel("inspect", str(tmp_path / "junk"))
        assert bad.returncode == 1 and "not a kvreel chunk file" in bad.stderr, junk


def test_help_is_plain_text_and_readme_lists_every_command():
    import re
    from pathlib import Path
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    listed = re.search(r"## Command line\n+```\n(.*?)```", readme, re.S).group(1)
    top = kvreel("--help")
    commands = re.search(r"\{([a-z,-]+)\}", top.stdout).group(1).split(",")
    assert len(commands) >= 8
    for command in commands:
        assert re.search(rf"^kvreel {command}\b", listed, re.M), command
        out = kvreel(command, "--help")
        assert out.returncode == 0 and "usage:" in out.stdout, command
        assert not re.search(r"``|:(func|class|mod):", out.stdout), command
    assert not re.search(r"``|:(func|class|mod):", top.stdout)


def test_bench_lists_and_refuses_unknown_names():
    out = kvreel("bench")
    assert out.returncode == 0 and "remote_fetch" in out.stdout and "retrieval_quality" in out.stdout
    bad = kvreel("bench", "nope")
    assert bad.returncode == 2 and "unknown benchmark 'nope'" in bad.stderr


def test_layout_search_caches_the_tiling(tiny_model, tmp_path):
    import json
    out = kvreel("layout-search", "--model", tiny_model, "--tokens", "64", "--resolution", "144",
                 env={"XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "best tiling for" in out.stdout and "tilings" in out.stderr          # tqdm progress on stderr
    cached = json.loads((tmp_path / "kvreel" / "layouts.json").read_text())
    assert len(cached) == 1 and {"head_rows", "fold"} <= set(next(iter(cached.values())))


@pytest.mark.vllm
def test_publish_uploads_documents_that_a_fresh_engine_reuses(tiny_model, tmp_path):
    from transformers import AutoTokenizer
    from conftest import run_scenario
    doc = tmp_path / "doc.py"
    doc.write_text(open(os.__file__).read()[:6000])
    store = f"file://{tmp_path / 'store'}"
    out = kvreel("publish", "--model", tiny_model, "--remote-url", store, "--max-model-len", "2048", str(doc),
                 env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "published 1 documents" in out.stdout
    ids = AutoTokenizer.from_pretrained(tiny_model)(doc.read_text())["input_ids"][:2047]
    res = run_scenario({"model": tiny_model, "kvreel": {"cpu_bytes": "0", "remote_url": store},
                        "phases": [{"prompts": [ids]}]})
    assert res["phases"][0][0]["num_cached_tokens"] == (len(ids) - 1) // 32 * 32
    assert res["metrics"]["vllm:kvreel_lookup_hit_blocks_total|remote"] == (len(ids) - 1) // 32


def test_serve_refuses_a_bad_setting_in_one_line_without_importing_vllm():
    check = ("import sys; from kvreel.cli.main import main; rc = main(sys.argv[1:]); "
             "print('vllm imported' if 'vllm' in sys.modules else 'vllm not imported'); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", check, "serve", "some/model", "--port", "8000"],
                         capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")},
                              "KVREEL_CPU_BYTES": "lots"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "kvreel: KVREEL_CPU_BYTES='lots' is invalid: expected a size >= 0B such as 512MiB, 8GiB or 1000000"]
    assert out.stdout.strip() == "vllm not imported"


def test_serve_attaches_kvreel_on_loopback_and_passes_the_rest_to_vllm(monkeypatch):
    import json

    from kvreel.cli.serve import API_SERVER, server_command
    monkeypatch.delenv("KVREEL_CPU_BYTES", raising=False)
    cmd = server_command(["m", "--port", "8000", "--max-model-len", "4096"])
    assert cmd[:3] == [sys.executable, "-m", API_SERVER]
    args = cmd[3:]
    assert args[:6] == ["--model", "m", "--port", "8000", "--max-model-len", "4096"]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVReelConnector" and transfer["kv_connector_module_path"] == "kvreel.connector"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    ours = '{"kv_connector":"KVReelConnector","kv_connector_module_path":"kvreel.connector","kv_role":"kv_both",' \
           '"kv_connector_extra_config":{"cpu_bytes":"2GiB"}}'
    given = ["--model=m", "--host", "0.0.0.0", f"--kv-transfer-config={ours}"]
    assert server_command(given)[3:] == given
    for argv, said in ((["--port", "8000"], "name the model"),
                       (["m", "--kv-transfer-config", ours.replace("KVReel", "Example")], "names 'ExampleConnector'"),
                       (["m", "--kv-transfer-config", "{"], "--kv-transfer-config is not JSON"),
                       (["m", "--kv-transfer-config", ours.replace("2GiB", "-1")], r"\['cpu_bytes'\]='-1' is invalid")):
        with pytest.raises(ValueError, match=said):
            server_command(argv)
