#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite on CPU. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false UCX_NET_DEVICES=lo
log=$(mktemp)
set +e
python3 -m pytest tests -q -rfEs --durations=30 --timeout=900 -p no:cacheprovider "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
# Mooncake's C++ logs a few lines at interpreter exit, after pytest's summary: repeat the summary last.
grep -E "^[0-9]+ (passed|failed)|^(=+ )?[0-9]+ (passed|failed)|no tests ran" "$log" | tail -1
rm -f "$log"
exit "$rc"
