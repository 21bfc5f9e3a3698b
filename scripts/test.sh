#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite on CPU. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false UCX_NET_DEVICES=lo
exec python3 -m pytest tests -q -rfEs --timeout=900 -p no:cacheprovider "$@"
