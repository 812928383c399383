#!/usr/bin/env bash
# Creates .venv-trl: TRL's GRPOTrainer (PyTorch) in its own environment, for
# benchmarks/whole_step.py. Never in requirements.txt.
#
# Run from the repo root: `bash benchmarks/setup_trl.sh` (a few minutes; needs only PyPI).
# torch and transformers are pinned to the versions of our dev environment (the parity tests'),
# so the three implementations load the same weights with the same Hugging Face code.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL_VENV:-.venv-trl}"
source benchmarks/peer_venv.sh
peer_venv "$VENV"
"$VENV/bin/python" -m pip install -q \
  torch==2.13.0 transformers==5.23.0 trl==1.16.0 math-verify==0.9.0 numpy
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("trl", "torch", "transformers", "accelerate", "datasets", "math-verify"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
import trl  # noqa: F401  (fails loudly here if the install is broken)
print("trl imports")
PY
