#!/usr/bin/env bash
# The wheels the GPU check carries (into .whl/, git-ignored through .git/info/exclude): our
# dependencies that the GPU machine's image lacks (or has at a version that does not import with
# its JAX 0.11: flax), for its Python 3.12, without their own dependencies (the image has them).
# About 11 MiB; the device tool carries at most 64 MiB with the checkout.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
WHEELS=(
  flax==0.12.12 ml-collections==1.1.0 tensorflow-datasets==4.9.10 array-record==0.8.6
  grain==0.2.18 math-verify==0.9.0 latex2sympy2_extended==1.11.0
  antlr4-python3-runtime==4.13.2 gguf==0.19.0 tensorboardX==2.6.5 dm-tree==0.1.10
  immutabledict==4.3.1 simple_parsing==0.1.9 docstring-parser==0.18.0
  tensorflow-metadata==1.21.0 termcolor==3.3.0 toml==0.10.2 portpicker==1.6.0
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
# promise (tensorflow-datasets needs it) is published as a source archive only: build its wheel.
"$PY" -m pip wheel -q --no-deps -w .whl promise==2.3
du -sh .whl
