"""README's first command: ``kvreel demo`` serves a tiny model with vLLM's
OpenAI server and kvreel attached, and shows the prefix coming back from
kvreel; a bad setting stops it before vLLM starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

import pytest


def demo(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    return subprocess.run([sys.executable, "-m", "kvreel.cli.main", "demo", "--model-dir",
                           str(tmp_path / "tiny"), "--prompt-tokens", "1500"],
                          capture_output=True, text=True, env={**base, **env}, timeout=600)


def test_demo_refuses_a_bad_setting_before_starting_vllm(tmp_path):
    out = demo(tmp_path, KVREEL_CPU_BYTES="lots")
    assert out.returncode == 2
    assert out.stderr.strip() == ("kvreel demo: KVREEL_CPU_BYTES='lots' is invalid: expected a size >= 0B such as "
                                  "512MiB, 8GiB or 1000000")
    assert not (tmp_path / "vllm-serve.log").exists() and not (tmp_path / "tiny").exists()


@pytest.mark.vllm
def test_demo_shows_a_reuse_from_kvreel_and_every_tier_counter(tmp_path):
    out = demo(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "python -m vllm.entrypoints.openai.api_server" in out.stdout
    cold, warm = (re.search(rf"^{label}\s+(\d+)\s+(\d+)\s", out.stdout, re.M).groups()
                  for label in ("cold prefill", r"after vLLM's prefix cache was reset"))
    assert int(cold[1]) == 0 and int(warm[1]) == (int(warm[0]) - 1) // 32 * 32
    assert re.search(r"prefix reused from kvreel's host tier: \d+ tokens, [\d.]+(KiB|MiB) of KV restored", out.stdout)
    hits = dict(re.findall(r'vllm:kvreel_lookup_hit_blocks_total\{.*tier="(\w+)"\} ([\d.]+)', out.stdout))
    assert float(hits["host"]) >= int(warm[1]) // 32
    assert hits["disk"] == hits["remote"] == "0.0"        # exported before their first hit


@pytest.mark.vllm
def test_the_readme_cpu_recipe_pasted_as_is_shows_a_kvreel_hit(tmp_path):
    """README's own-server block for a CPU machine, run verbatim by bash (only
    its port moved to a free one), from a directory whose .venv is this one."""
    from pathlib import Path

    from conftest import free_port
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"paste this block.*?```bash\n(.*?)```", readme, re.S).group(1)
    (tmp_path / ".venv").symlink_to(sys.prefix)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVREEL_")}
    server_log = tmp_path / ".kvreel/server.log"
    recipe = subprocess.Popen(["bash", "-c", block.replace("8000", str(free_port()))], cwd=tmp_path, env=base,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = recipe.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(recipe.pid, signal.SIGKILL)
        stdout, stderr = recipe.communicate()
        pytest.fail("the recipe did not finish in 600 s; its output:\n" + stdout + stderr[-2000:] +
                    "\nthe server's log:\n" + (server_log.read_text()[-6000:] if server_log.exists() else "none"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(recipe.pid, signal.SIGKILL)     # the server too, had the recipe stopped before its `kill`
    cached = [int(n) for n in re.findall(r"^cached prompt tokens: (\d+)$", stdout, re.M)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 3000, stdout + stderr[-2000:] + \
        server_log.read_text()[-3000:]
    assert re.search(r'^vllm:kvreel_lookup_hit_blocks_total\{.*tier="host"\} (\d+)', stdout, re.M)
