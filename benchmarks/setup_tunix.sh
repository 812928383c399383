#!/usr/bin/env bash
# Creates .venv-tunix: google-tunix 0.1.7 in its own environment, for benchmarks/tunix_rollout.py.
#
# Run from the repo root: `bash benchmarks/setup_tunix.sh` (a few minutes; needs only PyPI).
# Tunix requires safetensors<0.8 (ours is 0.8.0) and pulls datasets, numba, kagglehub, qwix..., so
# it never goes into requirements.txt. We first ask pip for the same jax/jaxlib/flax as the main
# venv (same XLA, so the comparison measures the libraries, not the compiler); if pip cannot
# resolve that, we let it choose and the benchmark prints the versions it ran with.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TUNIX_VENV:-.venv-tunix}"
source benchmarks/peer_venv.sh
peer_venv "$VENV"

same_xla=(jax==0.10.2 jaxlib==0.10.2 flax==0.12.8)
if ! "$VENV/bin/python" -m pip install -q google-tunix==0.1.7 "${same_xla[@]}"; then
  echo "setup_tunix: tunix does not install with ${same_xla[*]}; letting pip choose jax/flax." >&2
  "$VENV/bin/python" -m pip install -q google-tunix==0.1.7
fi
# benchmarks/whole_step.py hands tunix our math-verify reward (gvpo_jax.rewards: numpy, sympy,
# math-verify; no jax model code), so the worker needs math-verify too.
"$VENV/bin/python" -m pip install -q math-verify==0.9.0
# The tunix workers (benchmarks/tunix_rollout.py, whole_step.py --worker tunix) import tunix,
# jax, numpy, benchmarks/ and gvpo_jax.rewards; the rest of gvpo_jax and torch stay in the main venv.
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("google-tunix", "jax", "jaxlib", "flax", "safetensors", "transformers", "qwix"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
import tunix  # noqa: F401  (fails loudly here if the install is broken)
print("tunix imports")
EOF
