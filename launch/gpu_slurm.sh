#!/usr/bin/env bash
# Runs gvpo_jax on a multi-node GPU cluster with SLURM: one process per node (it drives all the
# node's GPUs), the first node of the allocation is the JAX coordinator.
#
#   launch/gpu_slurm.sh [--nodes 2] [--gpus_per_node 8] [--partition P] [--account A]
#       [--time 24:00:00] [--port 12355] [--dry-run] -- MAIN_ARGS...
#
# Outside an allocation it submits itself with sbatch (same options); inside one (SLURM_JOB_ID
# set) it runs `srun` with JAX_COORDINATOR_ADDRESS=<first node>:<port>, JAX_NUM_PROCESSES =
# number of tasks and JAX_PROCESS_ID = SLURM_PROCID, which gvpo_jax.sharding reads.
# PYTHON selects the interpreter on the nodes (default: python of the submitting shell's PATH).
# Example:
#   launch/gpu_slurm.sh --nodes 2 --partition gpu -- --config=configs/qwen_math.py \
#       --config.model.hf_dir=/shared/Qwen2.5-Math-7B --config.data.path=/shared/math \
#       --workdir=/shared/runs/qwen_math
# The workdir, weights and data must be on a file system all nodes share.
# --dry-run prints the sbatch and srun commands instead of running them.
set -euo pipefail

nodes=2
gpus_per_node=8
partition=""
account=""
time_limit=""
port=12355
dry_run=0
python_bin="${PYTHON:-python}"
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --gpus_per_node) gpus_per_node="$2"; shift 2 ;;
    --partition) partition="$2"; shift 2 ;;
    --account) account="$2"; shift 2 ;;
    --time) time_limit="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (main's arguments go after --)." >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "error: give gvpo_jax.main's arguments after --, e.g. -- --config=configs/qwen_math.py" >&2
  exit 2
fi

quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}
show() {
  local out="" word
  for word in "$@"; do out+="${out:+ }$(quote "$word")"; done
  printf '%s\n' "$out"
}
run() { if [[ "$dry_run" == 1 ]]; then show "$@"; else "$@"; fi; }

# The per-task command: the process id is only known inside the task (SLURM_PROCID).
task_script='export JAX_PROCESS_ID="$SLURM_PROCID"; exec "$0" -m gvpo_jax.main "$@"'

srun_command() {  # $1: coordinator host, $2: number of nodes, then main's arguments
  local host="$1" n="$2"
  shift 2
  srun_cmd=(srun --nodes="$n" --ntasks-per-node=1 --gpus-per-node="$gpus_per_node" --kill-on-bad-exit=1
            --export="ALL,JAX_COORDINATOR_ADDRESS=${host}:${port},JAX_NUM_PROCESSES=${n}"
            bash -c "$task_script" "$python_bin" "$@")
}

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  sbatch_cmd=(sbatch --nodes="$nodes" --ntasks-per-node=1 --gpus-per-node="$gpus_per_node"
              --job-name=gvpo_jax --output=gvpo_jax-%j.out)
  [[ -n "$partition" ]] && sbatch_cmd+=(--partition="$partition")
  [[ -n "$account" ]] && sbatch_cmd+=(--account="$account")
  [[ -n "$time_limit" ]] && sbatch_cmd+=(--time="$time_limit")
  inner=("$self" --nodes "$nodes" --gpus_per_node "$gpus_per_node" --port "$port" -- "$@")
  sbatch_cmd+=(--export="ALL,PYTHON=${python_bin}" --wrap "$(show "${inner[@]}")")
  run "${sbatch_cmd[@]}"
  if [[ "$dry_run" == 1 ]]; then
    echo "# then, inside the allocation (HEAD = its first node):"
    srun_command '$HEAD' "$nodes" "$@"
    show "${srun_cmd[@]}"
  else
    echo "Submitted; logs in gvpo_jax-<jobid>.out (squeue -u \$USER to follow)."
  fi
  exit 0
fi

n="${SLURM_JOB_NUM_NODES:-$nodes}"
if command -v scontrol >/dev/null 2>&1; then
  head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
else
  head="${SLURM_JOB_NODELIST%%,*}"  # plain "node1,node2" lists; scontrol handles ranges
fi
srun_command "$head" "$n" "$@"
run "${srun_cmd[@]}"
