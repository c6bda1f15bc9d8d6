"""deploy/ for real: the CPU image and the store image built on a local Debian 12
base, the compose stack (vLLM + kvreel, Redis from Debian's package, the DRE in
a container of its own) brought up, asked through its published loopback port,
and taken down; then the fleet profile from the same images (two engines on a
Redis Cluster behind vllm-router).

No registry is needed: the base is made with mmdebstrap from the machine's own
apt sources and ``docker import``ed; apt inside the build uses the same mirror
(host networking), and pip the index, wheel folder and CA bundle this machine's
pip is configured with, served to the build over loopback HTTP."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import free_port, tokens
from kvreel.cli.server_process import http
from bench.common import read_counters

pytestmark = pytest.mark.docker

ROOT = Path(__file__).parents[1]
BASE_IMAGE = "kvreel-local-base:bookworm"
PROJECT = "kvreeltest"
BUILD_ROOM = 12 * 2**30                 # the CPU image (4.4 GB) and its build's layers, the store, the base


def sh(*cmd, env=None, timeout=1800, input_text=None) -> str:
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout,
                          input=input_text)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory):
    """A running Docker engine; started here (as root) when none is."""
    for tool in ("docker", "docker-compose", "mmdebstrap"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (Debian packages docker.io, docker-compose, mmdebstrap; "
                        "deploy/setup.sh installs them as root)")
    started = None
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.geteuid() != 0:
            pytest.fail("no Docker engine is running, and starting one needs root")
        log = (tmp_path_factory.mktemp("dockerd") / "dockerd.log").open("w")
        started = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            assert started.poll() is None and time.monotonic() < deadline, f"dockerd did not start; see {log.name}"
            time.sleep(1)
    yield
    if started is not None:
        started.terminate()
        started.wait(timeout=60)


def image_ids() -> set[str]:
    return set(sh("docker", "images", "--all", "--quiet", "--no-trunc").split())


@pytest.fixture
def images_made_here(docker_engine):
    """Room for the images, and every image this test makes (base, intermediate layers
    of a failed build, final images) removed afterwards: each run builds from scratch,
    so what one run leaves would otherwise fill the disk of the next (4.4 GB a run)."""
    root = sh("docker", "info", "--format", "{{.DockerRootDir}}").strip()
    free = shutil.disk_usage(root).free if os.path.isdir(root) else BUILD_ROOM      # a remote engine: unknown
    if free < BUILD_ROOM:
        pytest.fail(f"Docker's data root {root} has {free / 2**30:.1f} GiB free; building the images needs "
                    f"{BUILD_ROOM / 2**30:.0f} GiB (docker image prune -a frees what no container uses)")
    before = image_ids()
    yield
    made = image_ids() - before
    for _ in range(3):                  # children before parents: a parent goes once its children have
        if not made:
            return
        subprocess.run(["docker", "rmi", "--force", *made], capture_output=True, timeout=300)
        made = image_ids() - before
    print("images this test made and could not remove:", made)


def local_base(tmp: Path) -> str:
    """Debian 12 made today with mmdebstrap (the machine's apt sources, with their
    point and security updates), so the images are built on the base a new user
    gets now, never on one cached from an earlier run."""
    tar = tmp / "bookworm.tar"
    sh("mmdebstrap", "--variant=minbase", "--include=ca-certificates", "bookworm", tar, timeout=900)
    sh("docker", "import", tar, BASE_IMAGE)
    return BASE_IMAGE


def pip_sources() -> dict[str, str]:
    """What this machine's pip is configured with: index, wheel folders, CA bundle."""
    out: dict[str, str] = {}
    for line in sh(sys.executable, "-m", "pip", "config", "list").splitlines():
        key, _, value = line.partition("=")
        out.setdefault(key.rpartition(".")[2], value.strip("'\""))
    return out


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve_build_inputs(tmp: Path) -> tuple[dict[str, str], ThreadingHTTPServer]:
    """Build arguments for the images (as compose reads them from the environment),
    and a loopback HTTP server for the files they name."""
    pip = pip_sources()
    root = tmp / "build-inputs"
    root.mkdir()
    handler = partial(QuietHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    args = {"BASE_IMAGE": local_base(tmp)}
    if "index-url" in pip:
        args["BUILD_PIP_INDEX_URL"] = pip["index-url"]
    wheels = pip.get("find-links", "").split()
    if wheels and Path(wheels[0]).is_dir():
        (root / "wheels").symlink_to(wheels[0])
        args["BUILD_PIP_FIND_LINKS"] = f"{url}/wheels/"
        if list(Path(wheels[0]).glob("torch-2.13.0*.whl")):
            args["BUILD_TORCH_INDEX_URL"] = ""    # the CPU torch wheel is in the folder
    if pip.get("cert") and Path(pip["cert"]).is_file():
        (root / "ca.pem").symlink_to(pip["cert"])
        args["BUILD_PIP_CERT_URL"] = f"{url}/ca.pem"
    return args, server


def readable_copy(model: str, tmp: Path) -> Path:
    """The model where the image's unprivileged user can read it (pytest's folders are private)."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    shutil.copytree(model, out / "model")
    for path in [out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out / "model"


def wait_healthy(base: str, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"{what} did not become healthy"
            time.sleep(2)


def completion(base: str, prompt: list[int], max_tokens: int) -> dict:
    _, body = http(base + "/v1/completions", {"model": "/models/model", "prompt": prompt,
                                               "max_tokens": max_tokens, "temperature": 0})
    return json.loads(body)


def build_context_files() -> list[str]:
    """What the daemon receives as the build context: a throwaway image that copies
    the context whole, built with the same context and .dockerignore as compose."""
    probe = "FROM scratch\nCOPY . /context\n"
    tag = f"{PROJECT}-context-probe"
    sh("docker", "build", "-q", "-f", "-", "-t", tag, ROOT, input_text=probe)
    try:
        with tempfile.TemporaryDirectory() as out:
            container = sh("docker", "create", tag, "/none").strip()
            sh("docker", "cp", f"{container}:/context", out)
            sh("docker", "rm", container)
            return sorted(str(p.relative_to(Path(out, "context"))) for p in Path(out, "context").rglob("*")
                          if p.is_file())
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


@pytest.mark.timeout(2700)          # the images are built from scratch, every run
def test_compose_stack_serves_reuse_and_retrieval(images_made_here, tiny_model, tmp_path):
    # only what the images copy is sent to the daemon (.dockerignore): no .venv, .git or results
    sent = build_context_files()
    assert "pyproject.toml" in sent and "connector/kvreel_connector.py" in sent
    assert not [f for f in sent if f.split("/")[0] not in ("pyproject.toml", "README.md", "connector", "codec",
                                                           "scheduler", "dre", "cli", "deploy")], sent
    args, server = serve_build_inputs(tmp_path)
    port = free_port()
    env = {**os.environ, **args, "KVREEL_IMAGE_TAG": "test", "KVREEL_PORT": str(port),
           "MODEL_DIR": str(readable_copy(tiny_model, tmp_path)),
           "STORE_PASSWORD": secrets.token_hex(16), "DRE_SECRET_HEX": secrets.token_hex(16),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "KVREEL_CPU_BYTES": "256MiB",
           # retrieval for prompts past 512 tokens, narrowed by the DRE's container's clusters
           "KVREEL_RETRIEVAL": "resv", "KVREEL_RETRIEVAL_MIN_TOKENS": "512", "KVREEL_RETRIEVAL_WINDOW": "64",
           "KVREEL_RETRIEVAL_BUDGET_TOKENS": "256", "KVREEL_RETRIEVAL_CANDIDATES": "2"}
    compose = ["docker-compose", "-f", ROOT / "deploy" / "compose.yaml", "-p", PROJECT]
    try:
        t0 = time.monotonic()
        # no layer from an earlier run: a pin the base has moved past fails here, not on a user's machine
        sh(*compose, "build", "--no-cache", "--force-rm", env=env, timeout=2400)
        print(f"images built from scratch in {time.monotonic() - t0:.0f} s")
    finally:
        server.shutdown()
    try:
        sh(*compose, "up", "-d", env=env, timeout=600)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 600, "vLLM in the stack")
        prompt = tokens(600, 11)
        completion(base, prompt, 4)
        http(base + "/reset_prefix_cache", {})
        again = completion(base, prompt, 4)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512     # from kvreel, not vLLM
        completion(base, tokens(900, 12), 16)                                      # past the threshold
        counters = read_counters(base, ("lookup_hit_blocks", "saved_bytes", "retrieval_steps"))
        print("kvreel's counters in the stack:", counters)
        assert counters["lookup_hit_blocks_total|host"] > 0
        assert counters["saved_bytes_total|remote"] > 0                           # uploaded to the store
        # the DRE, in a container of its own (another IPC namespace), selected what was attended to
        assert counters["retrieval_steps_total|selected"] > 0
        assert counters["retrieval_steps_total|dre_down"] == 0
        sh(*compose, "down", "-v", env=env, timeout=300)
        check_fleet(compose, env)
    except BaseException:
        print(subprocess.run([*map(str, compose), "--profile", "fleet", "logs", "--no-color", "--tail", "80"],
                             env=env, capture_output=True, text=True).stdout)
        raise
    finally:
        subprocess.run([*map(str, compose), "--profile", "fleet", "down", "-v"], env=env, capture_output=True,
                       timeout=300)


def check_fleet(compose: list, env: dict) -> None:
    """The fleet profile from the same images: two engines on a 3-master Redis Cluster
    behind vllm-router's kv_aware policy. A prefix pushed out of its engine's paged
    cache is routed back to that engine and served by kvreel's host tier; the other
    engine reuses it from the cluster."""
    ports = {name: free_port() for name in ("KVREEL_FLEET_PORT", "KVREEL_FLEET_ENGINE_A_PORT",
                                             "KVREEL_FLEET_ENGINE_B_PORT")}
    env = {**env, **{k: str(v) for k, v in ports.items()},
           "FLEET_VLLM_EXTRA_ARGS": "--num-gpu-blocks-override 80 --max-model-len 2048"}
    sh(*compose, "--profile", "fleet", "up", "-d", "router", env=env, timeout=900)   # waits for healthy engines
    router = f"http://127.0.0.1:{ports['KVREEL_FLEET_PORT']}"
    engines = [f"http://127.0.0.1:{ports[k]}" for k in ("KVREEL_FLEET_ENGINE_A_PORT", "KVREEL_FLEET_ENGINE_B_PORT")]
    wait_healthy(router, 120, "the router")
    prefix = tokens(700, 21)                              # 21 full blocks of 32
    assert completion(router, prefix + tokens(20, 22), 2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    saved = [read_counters(e, ("saved_bytes",)).get("saved_bytes_total|host", 0) for e in engines]
    holder, other = (0, 1) if saved[0] > 0 else (1, 0)
    assert saved[holder] > 0 and saved[other] == 0
    for k in range(6):                                    # out of the holder's paged cache (80 blocks)
        completion(engines[holder], tokens(900, 30 + k), 1)
    hits = read_counters(engines[holder], ("lookup_hit_blocks",))["lookup_hit_blocks_total|host"]
    again = completion(router, prefix + tokens(20, 23), 2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 672      # routed back to the holder ...
    assert read_counters(engines[holder], ("lookup_hit_blocks",))["lookup_hit_blocks_total|host"] - hits == 21
    elsewhere = completion(engines[other], prefix + tokens(20, 24), 2)          # ... and shared through the cluster
    assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] == 672
    assert read_counters(engines[other], ("lookup_hit_blocks",))["lookup_hit_blocks_total|remote"] == 21
