#!/usr/bin/env bash
# Every benchmark of BENCHMARKS.md in one run: `bash benchmarks/run_all.sh [--quick]` from anywhere.
#
# About 20 minutes on a quiet 2-core CPU (about 2 minutes with --quick). Sets up .venv-tunix first if it is
# missing (PyPI only; pass --no-tunix to skip tunix entirely). Everything printed also goes to
# runs/bench/<UTC date>.log, which holds the command, date, machine and every table.
# The machine should be otherwise idle: each table prints the load average next to its figures.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
QUICK=()
TUNIX=1
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=(--quick) ;;
    --no-tunix) TUNIX=0 ;;
    *) echo "usage: bash benchmarks/run_all.sh [--quick] [--no-tunix]" >&2; exit 2 ;;
  esac
done
mkdir -p runs/bench
LOG="runs/bench/$(date -u +%Y%m%dT%H%M%SZ).log"
exec > >(tee "$LOG") 2>&1

echo "# bash benchmarks/run_all.sh $*"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); git: $(git rev-parse --short HEAD 2>/dev/null || echo none)"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); cores: $(nproc); $(uptime)"

SKIP_TUNIX=()
if [ "$TUNIX" = 1 ]; then
  [ -x .venv-tunix/bin/python ] || bash benchmarks/setup_tunix.sh || echo "tunix set-up failed"
else
  export TUNIX_PYTHON=/nonexistent  # the scripts then report tunix as not measured
  SKIP_TUNIX=(--skip-tunix)
fi
# Python warnings (deprecations of the libraries compared) are noise in the tables.
export PYTHONWARNINGS=ignore TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1

run() { echo; echo "## \$ $*"; "$@"; }
# 0. The host: XLA's fp32 matmul against PyTorch's at SmolLM2's shapes (section 29).
run "$PY" -m benchmarks.matmul_shapes "${QUICK[@]}"
# 1. Rollout: ours vs transformers (benchmarks/rollout.py), ours vs tunix.
run "$PY" -m benchmarks.rollout --repeats 3 --hf-repeats 2 "${QUICK[@]}"
run "$PY" -m benchmarks.tunix_rollout --repeats 3 "${QUICK[@]}"
# 2 + 3. Update step vs PyTorch and tunix, MFU against the measured matmul peak, recompiles.
run "$PY" -m benchmarks.update_step --repeats 3 "${QUICK[@]}" "${SKIP_TUNIX[@]}"
# 3. Peak memory of token log-probs, chunked vs naive, at Qwen's vocabulary 151936.
if [ ${#QUICK[@]} -eq 0 ]; then
  run "$PY" -m benchmarks.logprob_memory --vocab 151936
else
  run "$PY" -m benchmarks.logprob_memory --vocab 151936 --batch 1 --length 256
fi
# 4. Scaling with group size and response length.
run "$PY" -m benchmarks.scaling --repeats 2 "${QUICK[@]}"
echo; echo "log: $LOG"
