#!/usr/bin/env bash
# The GPU machine's command (run from the checkout's root, with .whl carried):
#   bash benchmarks/gpu/run.sh            -> $OUT/check.jsonl, $OUT/check.log
# Installs the carried wheels into /tmp/site (ahead of the image's packages on PYTHONPATH), then
# runs the check with a budget that leaves room for a rerun inside a 15-minute lease.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu_check}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' || true
python3 -m benchmarks.gpu.check --out "$OUT" "$@"
