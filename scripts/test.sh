#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite on CPU. `.ci/run` calls this.
# Arguments go to one pytest run over tests/, as options (e.g. -k, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false UCX_NET_DEVICES=lo
opts=(-q -rfEs --durations=30 --timeout=900 -p no:cacheprovider)
# Mooncake's C++ logs a few lines at interpreter exit, after pytest's summary: repeat the summary last.
summary() { grep -E "^[0-9]+ (passed|failed)|^(=+ )?[0-9]+ (passed|failed)|no tests ran" "$1" | tail -1; }
log=$(mktemp)
side_log=$(mktemp)
tmp=$(mktemp -d)
trap 'rm -rf "$log" "$side_log" "$tmp"' EXIT
set +e
if [ $# -gt 0 ]; then
  python3 -m pytest tests "${opts[@]}" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  summary "$log"
  exit "$rc"
fi
# Two lanes on the CPU's cores: tests/gpu (the GPU path's kernels through the Triton interpreter, one thread,
# no servers) runs niced beside the rest (servers, transfers, the router), which alone leave one of CI's two
# cores idle most of the time (a fresh clone on 2 cores: 47 min in one lane, 36 in two). The side lane's output
# follows the main lane's. Each lane has its own pytest temporary directory (a session removes older ones).
nice -n 10 python3 -m pytest tests/gpu "${opts[@]}" --basetemp="$tmp/side" > "$side_log" 2>&1 &
side_pid=$!
python3 -m pytest tests "${opts[@]}" --basetemp="$tmp/main" --ignore=tests/gpu 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
wait "$side_pid"
side_rc=$?
set -e
echo "==== the side lane: tests/gpu ===="
cat "$side_log"
echo "main lane: $(summary "$log")"
echo "side lane: $(summary "$side_log")"
[ "$rc" -eq 0 ] && [ "$side_rc" -eq 0 ]
