#!/usr/bin/env bash
# Runs gvpo_jax on a Cloud TPU VM slice: create it, copy this checkout to every worker, install,
# run the same `python -m gvpo_jax.main` on all workers (JAX's multi-controller runtime: one
# process per host), stream the logs, delete the slice (also on failure or Ctrl-C).
#
#   launch/tpu_pod.sh --name NAME --zone ZONE [--accelerator v5p-64] [--version RUNTIME]
#       [--project PROJECT] [--spot] [--keep] [--log FILE] [--dry-run] -- MAIN_ARGS...
#
# MAIN_ARGS go to gvpo_jax.main unchanged, e.g.
#   launch/tpu_pod.sh --name gvpo --zone us-east5-a --accelerator v5p-64 -- \
#       --config=configs/qwen_math.py --config.model.hf_dir=/mnt/models/Qwen2.5-Math-7B \
#       --config.data.path=/mnt/data/math --workdir=gs://BUCKET/runs/qwen_math
# The workdir must be shared by all hosts (a gs:// bucket): Orbax writes each host's shards there.
# Weights and data must be readable on every worker (a bucket mount or a disk you attach).
# The committed HEAD of this checkout is copied (git archive). --dry-run prints every command
# instead of running it. --keep leaves the slice running.
set -euo pipefail

name=""
zone=""
accelerator="v5p-64"
version=""
project=""
spot=0
keep=0
dry_run=0
log=""
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --accelerator) accelerator="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --spot) spot=1; shift ;;
    --keep) keep=1; shift ;;
    --log) log="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (main's arguments go after --)." >&2; exit 2 ;;
  esac
done

if [[ -z "$name" || -z "$zone" ]]; then
  echo "error: --name and --zone are required (see --help)." >&2
  exit 2
fi
if [[ $# -eq 0 ]]; then
  echo "error: give gvpo_jax.main's arguments after --, e.g. -- --config=configs/qwen_math.py" >&2
  exit 2
fi
if [[ -z "$version" ]]; then  # the TPU VM runtime image of each generation
  case "$accelerator" in
    v4-*) version="tpu-ubuntu2204-base" ;;
    v5litepod-*|v5e-*) version="v2-alpha-tpuv5-lite" ;;
    v5p-*) version="v2-alpha-tpuv5" ;;
    v6e-*) version="v2-alpha-tpuv6e" ;;
    *) echo "error: no default runtime for --accelerator $accelerator; pass --version." >&2; exit 2 ;;
  esac
fi
log="${log:-${name}.log}"

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$zone")
[[ -n "$project" ]] && where+=(--project "$project")

# Shell-quotes one word for display: plain words as they are, anything else in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Prints a command (copy-pasteable) in dry-run mode, runs it otherwise.
run() {
  if [[ "$dry_run" == 1 ]]; then
    local out="" word
    for word in "$@"; do out+="${out:+ }$(quote "$word")"; done
    printf '%s\n' "$out"
  else
    "$@"
  fi
}

main_args=""
for word in "$@"; do main_args+="${main_args:+ }$(quote "$word")"; done
install_cmd="mkdir -p ~/gvpo_jax && tar -xzf ~/gvpo_jax.tar.gz -C ~/gvpo_jax && cd ~/gvpo_jax \
&& python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt 'jax[tpu]==0.10.2' \
&& .venv/bin/pip install -q --no-deps -e ."
# GVPO_DISTRIBUTED=1: gvpo_jax.sharding.maybe_initialize_distributed lets JAX find the pod.
run_cmd="cd ~/gvpo_jax && GVPO_DISTRIBUTED=1 .venv/bin/python -m gvpo_jax.main ${main_args}"
tarball="${TMPDIR:-/tmp}/${name}-gvpo_jax.tar.gz"

delete_slice() {
  run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet
}

create=("${gcloud_tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$accelerator"
        --version "$version")
[[ "$spot" == 1 ]] && create+=(--spot)
run "${create[@]}"
if [[ "$keep" == 0 ]]; then
  if [[ "$dry_run" == 1 ]]; then
    echo "# on exit (success, failure or interrupt):"
    delete_slice
  else
    trap delete_slice EXIT
  fi
fi
run git -C "$here" archive --format=tar.gz -o "$tarball" HEAD
run "${gcloud_tpu[@]}" scp "$tarball" "${name}:~/gvpo_jax.tar.gz" "${where[@]}" --worker=all
run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$install_cmd"
# Every worker runs the same command; gcloud streams all workers' output, tee keeps a copy.
if [[ "$dry_run" == 1 ]]; then
  echo "$(run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$run_cmd") 2>&1 | tee $(quote "$log")"
else
  "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$run_cmd" 2>&1 | tee "$log"
fi
