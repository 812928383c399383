#!/usr/bin/env bash
# Runs N JAX processes on this machine (one coordinator on 127.0.0.1), the multi-host code path
# without a cluster: CPU processes with fake devices, or one process per local GPU group.
#
#   launch/local_multiprocess.sh [--num_processes 2] [--devices_per_process 2] [--platform cpu]
#       [--port 12355] [--module gvpo_jax.main] [--dry-run] [--] ARGS...
#
# Every process runs `python -m MODULE ARGS...` with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
# and JAX_PROCESS_ID set (gvpo_jax.sharding.maybe_initialize_distributed reads them). Output is
# streamed with a "[pI]" prefix per process. Exits non-zero if any process fails (the others are
# stopped). PYTHON overrides the interpreter (default: python).
# Example:
#   launch/local_multiprocess.sh --num_processes 2 --devices_per_process 4 -- \
#       --config=configs/arith_tiny.py --workdir=runs/mp_demo
set -euo pipefail

num_processes=2
devices_per_process=2
platform=cpu
port=12355
module=gvpo_jax.main
dry_run=0
python_bin="${PYTHON:-python}"

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --num_processes) num_processes="$2"; shift 2 ;;
    --devices_per_process) devices_per_process="$2"; shift 2 ;;
    --platform) platform="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --module) module="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

if ! [[ "$num_processes" =~ ^[1-9][0-9]*$ && "$devices_per_process" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: --num_processes and --devices_per_process must be positive integers." >&2
  exit 2
fi
if [[ "$platform" != cpu && "$platform" != gpu ]]; then
  echo "error: --platform must be cpu or gpu." >&2
  exit 2
fi

# The environment of process $1, in the array proc_env.
process_env() {
  local i="$1"
  proc_env=(
    "JAX_COORDINATOR_ADDRESS=127.0.0.1:${port}"
    "JAX_NUM_PROCESSES=${num_processes}"
    "JAX_PROCESS_ID=${i}"
  )
  if [[ "$platform" == cpu ]]; then
    # The caller's other XLA flags are kept; its fake device count is replaced.
    local flags
    flags=$(sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g; s/^ +//; s/ +$//' \
            <<< "${XLA_FLAGS:-}")
    proc_env+=("JAX_PLATFORMS=cpu"
               "XLA_FLAGS=${flags:+$flags }--xla_force_host_platform_device_count=${devices_per_process}")
  else
    local first=$((i * devices_per_process)) ids="" d
    for ((d = first; d < first + devices_per_process; d++)); do ids+="${ids:+,}${d}"; done
    proc_env+=("JAX_LOCAL_DEVICE_IDS=${ids}")
  fi
}

if [[ "$dry_run" == 1 ]]; then
  for ((i = 0; i < num_processes; i++)); do
    process_env "$i"
    printf 'env'
    printf ' %q' "${proc_env[@]}" "$python_bin" -m "$module" "$@"
    printf " 2>&1 | sed 's/^/[p%d] /' &\n" "$i"
  done
  echo "wait"
  exit 0
fi

pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup INT TERM

for ((i = 0; i < num_processes; i++)); do
  process_env "$i"
  # env execs python, so $! is the python process itself (killable, and `wait` gets its status).
  env "${proc_env[@]}" "$python_bin" -m "$module" "$@" > >(sed -u "s/^/[p${i}] /") 2>&1 &
  pids+=("$!")
done

remaining=("${pids[@]}")
while [[ ${#remaining[@]} -gt 0 ]]; do
  # wait -n -p: the first process to finish; a failure stops the others at once.
  finished=""
  if wait -n -p finished "${remaining[@]}"; then :; else
    status=$?
    echo "local_multiprocess: process with pid ${finished} failed (exit ${status}); stopping the rest." >&2
    cleanup
    wait || true
    exit "$status"
  fi
  next=()
  for pid in "${remaining[@]}"; do [[ "$pid" != "$finished" ]] && next+=("$pid"); done
  remaining=("${next[@]}")
done
wait  # the log prefixers
