# Sourced by benchmarks/setup_*.sh: `peer_venv DIR` makes a peer library's own virtualenv (once),
# keeps it out of git and out of `ruff .` (both honour nested .gitignore files) and upgrades pip.
# PYTHON picks the interpreter (default python3.11, else python3).
peer_venv() {
  local venv="$1" python="${PYTHON:-python3.11}"
  command -v "$python" >/dev/null || python=python3
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  echo '*' > "$venv/.gitignore"
  "$venv/bin/python" -m pip install -q --upgrade pip
}
