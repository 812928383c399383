"""Multi-host: real 2-process CPU runs (jax.distributed + gloo) of the sharded step and of the
trainer itself against one process, per-process data sharding, and the launch scripts' --dry-run
output."""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from gvpo_jax import config as config_lib
from gvpo_jax import data, tasks
from tests import mp_worker
from tests.conftest import TEST_XLA_FLAGS, child_env
from tests.helpers import PROGRAM_COUNTS

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, env=None, timeout=60) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", *map(str, args)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    """2 processes x 2 CPU devices, mesh (data 2, fsdp 2) with devices interleaved across the
    processes: parameters are split across processes and each process feeds only its rows (a
    non-contiguous set); 3 GVPO steps (with an Orbax save/restore of the sharded state after the
    first), a restore past a step damaged on one host only, then greedy sampling."""
    out = _run(
        [
            LAUNCH / "local_multiprocess.sh",
            "--num_processes",
            2,
            "--devices_per_process",
            2,
            "--port",
            _free_port(),
            "--module",
            "tests.mp_worker",
            "--",
            "--out",
            tmp_path,
        ],
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[p0] process 0: rows [0, 1, 2, 3, 8, 9, 10, 11] (data shard 0 of 2)" in out.stdout
    assert "[p1] process 1: rows [4, 5, 6, 7, 12, 13, 14, 15] (data shard 1 of 2)" in out.stdout
    result = dict(np.load(tmp_path / "result.npz"))
    assert int(result["process_count"]) == 2 and int(result["device_count"]) == 4
    # Step 2 damaged in process 1's files only: both processes resumed from step 1, and the
    # damaged step was reported once and moved aside.
    assert result["resumed"].tolist() == [1, 1]
    assert out.stdout.count("Checkpoint step 2 is damaged") == 1
    assert "[p0] Checkpoint step 2 is damaged" in out.stdout
    assert (tmp_path / "checkpoints" / "damaged-2").is_dir()
    init = {k.removeprefix("init/"): v for k, v in result.items() if k.startswith("init/")}
    ref = mp_worker.reference_run(init)
    # Same tolerance argument as tests/test_sharding.py: only summation order differs.
    np.testing.assert_allclose(result["losses"], ref["losses"], rtol=1e-5, atol=1e-7)
    assert len(init) > 5
    for name in init:
        np.testing.assert_allclose(result[name], ref[name], atol=1e-6, rtol=0, err_msg=name)
        assert np.abs(ref[name] - init[name]).max() > 0 or name.endswith("bias")
    np.testing.assert_array_equal(result["tokens"], ref["tokens"])


def test_local_launcher_stops_when_a_process_fails():
    out = _run(
        [LAUNCH / "local_multiprocess.sh", "--port", _free_port(), "--module", "no_such_module_x"],
        timeout=60,
    )
    assert out.returncode != 0
    # The first process to fail stops the other, which may not have printed anything yet.
    assert "failed" in out.stderr
    assert re.search(r"^\[p[01]\] .*no_such_module_x", out.stdout + out.stderr, re.M)


def test_local_launcher_dry_run():
    out = _run(
        [LAUNCH / "local_multiprocess.sh", "--dry-run", "--num_processes", 3]
        + ["--devices_per_process", 4, "--port", 4321, "--", "--config=configs/arith_tiny.py"]
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[-1] == "wait"
    for i, line in enumerate(lines[:3]):
        words = shlex.split(line)
        assert words[:4] == [
            "env",
            "JAX_COORDINATOR_ADDRESS=127.0.0.1:4321",
            "JAX_NUM_PROCESSES=3",
            f"JAX_PROCESS_ID={i}",
        ]
        (flags,) = [w for w in words if w.startswith("XLA_FLAGS=")]
        # the caller's fake device count replaced, its other XLA flags (the suite's) kept
        assert (
            flags.removeprefix("XLA_FLAGS=").split()[-1]
            == "--xla_force_host_platform_device_count=4"
        )
        assert flags.count("device_count") == 1 and TEST_XLA_FLAGS in flags
        cmd = words[words.index(sys.executable) :]
        assert cmd[:4] == [sys.executable, "-m", "gvpo_jax.main", "--config=configs/arith_tiny.py"]
        assert line.endswith(f"| sed 's/^/[p{i}] /' &")


def test_tpu_pod_dry_run_creates_runs_everywhere_and_deletes():
    tricky = "--config.data.template=it's x"
    out = _run(
        [LAUNCH / "tpu_pod.sh", "--name", "gvpo", "--zone", "us-east5-a", "--dry-run", "--"]
        + ["--config=configs/qwen_math.py", tricky, "--workdir=gs://b/run"]
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if not line.startswith("#")]
    words = [shlex.split(line.split(" 2>&1 | tee")[0]) for line in lines]
    assert words[0] == [
        *"gcloud compute tpus tpu-vm create gvpo --zone us-east5-a".split(),
        *"--accelerator-type v5p-64 --version v2-alpha-tpuv5".split(),
    ]
    assert words[1] == "gcloud compute tpus tpu-vm delete gvpo --zone us-east5-a --quiet".split()
    assert words[2][:3] == ["git", "-C", str(ROOT)] and "archive" in words[2]
    assert words[3][4] == "scp" and "--worker=all" in words[3]
    install, launch = words[4], words[5]
    assert install[4] == "ssh" and "--worker=all" in install
    assert "jax[tpu]==0.10.2" in install[-1]
    assert launch[4] == "ssh" and "--worker=all" in launch and lines[5].endswith("| tee gvpo.log")
    remote = shlex.split(launch[launch.index("--command") + 1])
    assert remote[:4] == ["cd", "~/gvpo_jax", "&&", "GVPO_DISTRIBUTED=1"]
    assert remote[4:] == [
        ".venv/bin/python",
        "-m",
        "gvpo_jax.main",
        "--config=configs/qwen_math.py",
        tricky,  # survives both levels of quoting
        "--workdir=gs://b/run",
    ]
    bad = _run([LAUNCH / "tpu_pod.sh", "--zone", "z", "--dry-run", "--", "--config=x"])
    assert bad.returncode == 2 and "--name and --zone are required" in bad.stderr


def test_gpu_slurm_dry_run_outside_and_inside_an_allocation():
    args = ["--config=configs/qwen_math.py", "--workdir=/shared/run"]
    env = {k: "" for k in os.environ if k.startswith("SLURM_")}
    out = _run(
        [LAUNCH / "gpu_slurm.sh", "--dry-run", "--nodes", 4, "--partition", "gpu", "--", *args], env
    )
    assert out.returncode == 0, out.stderr
    sbatch = shlex.split(out.stdout.splitlines()[0])
    assert sbatch[0] == "sbatch" and "--nodes=4" in sbatch and "--ntasks-per-node=1" in sbatch
    assert "--partition=gpu" in sbatch
    inner = shlex.split(sbatch[sbatch.index("--wrap") + 1])
    assert inner[0] == str(LAUNCH / "gpu_slurm.sh") and inner[-3:] == ["--", *args]
    inside = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_NODELIST": "node-a,node-b,node-c,node-d",
        "PATH": "/usr/bin:/bin",  # no scontrol here: the plain node list is parsed
    }
    out = _run([LAUNCH / "gpu_slurm.sh", "--dry-run", "--port", 2222, "--", *args], inside)
    assert out.returncode == 0, out.stderr
    srun = shlex.split(out.stdout.strip())
    assert srun[0] == "srun" and "--nodes=4" in srun and "--ntasks-per-node=1" in srun
    assert "--export=ALL,JAX_COORDINATOR_ADDRESS=node-a:2222,JAX_NUM_PROCESSES=4" in srun
    script = srun[srun.index("-c") + 1]
    assert 'JAX_PROCESS_ID="$SLURM_PROCID"' in script and "gvpo_jax.main" in script
    assert srun[-3:] == [sys.executable, *args]


def test_distributed_init_only_when_asked(monkeypatch):
    from gvpo_jax import sharding

    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("GVPO_DISTRIBUTED", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert sharding.maybe_initialize_distributed() is False  # a plain single-process run
    assert sharding.maybe_initialize_distributed(mode="off") is False
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(sharding.ShardingError, match="set JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        sharding.maybe_initialize_distributed()
    with pytest.raises(sharding.ShardingError, match="use auto, on or off"):
        sharding.maybe_initialize_distributed(mode="yes")


# ----------------------------------------------------------------------------------------------
# The trainer (`python -m gvpo_jax.main`) with 2 processes x 2 devices against 1 process x 4.

# arith_tiny shrunk (1 layer, one-digit sums: 40 SFT steps give non-zero, varied rewards); GVPO with
# dynamic sampling, a replay buffer and 2 shuffled minibatches, so every cross-process path runs
# (gathered rollout rounds, kept-group choice, replay, minibatch rows, eval, checkpoints, export).
MAIN_ARGS = [
    "--config=configs/arith_tiny.py", "--config.sft.steps=40", "--config.sft.batch_size=16",
    "--config.sft.lr=3e-3", "--config.data.arith.max_operand=4", "--config.data.arith.ops=+",
    "--config.data.eval_size=8", "--config.train.steps=3", "--config.train.eval_every=2",
    "--config.train.checkpoint_every=2", "--config.train.sample_log_every=1",
    "--config.rollout.prompts_per_step=8", "--config.rollout.group_size=4",
    "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.algo.dynamic_sampling=True",
    "--config.algo.replay_fraction=0.5", "--config.algo.num_minibatches=2",
    "--config.model.overrides.num_layers=1",  # compile time grows with the layer count
    "--config.train.eval_samples=1",  # greedy only: one sampler program less to compile
]  # fmt: skip
# Discrete outcomes of the same sampled tokens: must be equal.
EXACT = ("reward_mean", "accuracy", "response_len_mean", "response_len_max", "rollout_rounds",
         "replayed_groups", "equal_reward_group_frac", "truncated_frac", "eval/greedy")  # fmt: skip
# Wall-clock metrics, and the correlation of the near-zero implicit rewards with the rewards
# (r_theta ~ 1e-6 at the first steps: its correlation is dominated by round-off).
SKIP = ("time", "tokens_per_s", "reward_corr", *PROGRAM_COUNTS)


def _rows(workdir) -> list[dict]:
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def _restore_state(step_dir: Path) -> dict:
    """The saved train state (and reference) onto one device, shapes from the checkpoint."""
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.metadata(step_dir / "state").item_metadata.tree
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree)
        return ckptr.restore(step_dir / "state", target)


@pytest.mark.slow
def test_trainer_two_processes_match_one_process(tmp_path):
    """Both runs at once: `launch/local_multiprocess.sh` 2 processes x 2 CPU devices, and one
    process with 4 fake devices; same mesh (data 2 x fsdp 2: parameters split over fsdp inside
    a process, rows over both processes) and global batch."""
    one, two = tmp_path / "one", tmp_path / "two"
    env1 = child_env(4, JAX_PLATFORMS="cpu")
    env1 = {k: v for k, v in env1.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    cmd1 = [sys.executable, "-m", "gvpo_jax.main", *MAIN_ARGS, f"--workdir={one}"]
    t0 = time.perf_counter()
    single = subprocess.Popen(cmd1, cwd=ROOT, env=env1, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    multi = _run(
        [LAUNCH / "local_multiprocess.sh", "--num_processes", 2, "--devices_per_process", 2,
         "--port", _free_port(), "--", *MAIN_ARGS, f"--workdir={two}"],
        timeout=400,
    )  # fmt: skip
    out1, _ = single.communicate(timeout=400)
    print(f"both runs: {time.perf_counter() - t0:.1f}s wall")
    assert single.returncode == 0, out1[-3000:]
    assert multi.returncode == 0, multi.stdout[-3000:] + multi.stderr[-3000:]

    # Per-step metrics: one row per step (process 0 only), the same values.
    rows1, rows2 = _rows(one), _rows(two)
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1]
    rl = [r for r in rows1 if "reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert 0 < np.mean([r["reward_mean"] for r in rl]) < 1  # informative groups: a real test
    assert max(r["replayed_groups"] for r in rl) > 0
    worst = 0.0
    for r1, r2 in zip(rows1, rows2, strict=True):
        assert set(r1) == set(r2)
        for k in r1:
            if k in SKIP or k.endswith("_s") or k == "step":
                continue
            if k in EXACT:
                assert r1[k] == r2[k], (r1["step"], k, r1[k], r2[k])
            else:
                # Only the order of cross-device sums differs (gloo between processes vs XLA
                # in one); measured <= 1.1e-4 relative after 40 SFT + 3 RL steps.
                np.testing.assert_allclose(r2[k], r1[k], rtol=1e-3, atol=1e-5, err_msg=k)
                if abs(r1[k]) > 1e-3:  # relative error of the metrics above round-off size
                    worst = max(worst, abs(r2[k] - r1[k]) / abs(r1[k]))
    print(f"largest relative difference of metrics with |value| > 1e-3: {worst:.2e}")

    # Exported parameters (written by process 0 from all-gathered shards).
    (st1,) = (one / "export").glob("*.safetensors")
    (st2,) = (two / "export").glob("*.safetensors")
    p1, p2 = load_file(st1), load_file(st2)
    assert set(p1) == set(p2) and len(p1) > 5
    diff = max(float(np.abs(p1[k] - p2[k]).max()) for k in p1)
    print(f"largest exported parameter difference {diff:.2e}")
    assert diff < 1e-4  # round-off drift through 43 Adam updates (measured 2e-5)

    # Checkpoints of every process's shards: restorable, same state, data position and replay.
    for step in ("2", "3"):
        assert (two / "checkpoints" / step / "commit_success.txt").exists()
    s1 = _restore_state(one / "checkpoints" / "3")
    s2 = _restore_state(two / "checkpoints" / "3")
    updates = [int(s["state"]["updates"]) for s in (s1, s2)]
    assert updates == [6, 6]  # 3 steps x 2 minibatches
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64), atol=1e-4)
    meta1, meta2 = (json.load(open(w / "checkpoints/3/meta/metadata")) for w in (one, two))
    assert meta2["data"] == meta1["data"] and meta2["np_rng"] == meta1["np_rng"]
    # Stream position = SFT examples + every rollout round's fresh prompts (nothing dropped).
    fresh = sum(r["rollout_rounds"] * (8 - r["replayed_groups"]) for r in rl)
    assert meta2["data"] == {"position": 40 * 16 + fresh, "dropped": 0}

    # Only process 0 wrote metrics, samples, plots and the export, and printed the progress.
    assert len(list((two / "tb").iterdir())) == 1
    assert len(open(two / "samples.jsonl").readlines()) == 3
    assert (two / "curves.png").stat().st_size > 5000
    p1_lines = [line for line in multi.stdout.splitlines() if line.startswith("[p1]")]
    assert not any(w in line for line in p1_lines for w in ("[rl]", "[eval]", "Exported"))
    assert "[p0] [rl] step 3/3" in multi.stdout and "[p0] Exported the policy" in multi.stdout


# ----------------------------------------------------------------------------------------------
# Per-process data: 2 fake processes (threads with an all-gather) compose the 1-process batch.


def _task_config(max_prompt_len):
    c = config_lib.base_config()
    c.data.max_prompt_len = max_prompt_len  # short: some prompts of the stream are dropped
    c.data.eval_size = 8
    return c


class _Exchange:
    """An all-gather among threads standing in for processes."""

    def __init__(self, n):
        self.barrier, self.slots = threading.Barrier(n, timeout=30), [None] * n

    def allgather(self, i):
        def fn(x):
            self.slots[i] = np.asarray(x)
            self.barrier.wait()
            out = np.stack(self.slots)
            self.barrier.wait()
            return out

        return fn


def test_task_stream_is_the_one_process_grain_stream():
    """One data shard: the examples are those of the grain iterator used before (single-process
    runs are unchanged), minus the prompts that do not fit; the position resumes exactly."""
    c = _task_config(max_prompt_len=5)
    tok = data.build_char_tokenizer()
    task = tasks.build_task(c, tok)
    held_out_drops = task.start.dropped  # the held-out set's own drops, counted at construction
    first, cursor = task.next_train(6, task.start)
    second, cursor = task.next_train(10, cursor)
    got = [ex["id"] for ex in first + second]
    it = data.make_iterator(tasks._load(c, "train"), seed=c.seed, batch_size=1, shard_index=0,
                            shard_count=1)  # fmt: skip
    stream = [next(it)[0] for _ in range(cursor.position)]
    fits = [ex["id"] for ex in stream if len(tok.encode(ex["prompt"])) <= 5]
    assert got == fits and cursor.dropped - held_out_drops == len(stream) - len(fits) > 0
    state = cursor.state_dict()
    after = [ex["id"] for ex in task.next_train(7, cursor)[0]]
    resumed = tasks.build_task(c, tok)
    saved = tasks.DataCursor.from_state_dict(json.loads(json.dumps(state)))
    assert [ex["id"] for ex in resumed.next_train(7, saved)[0]] == after


@pytest.mark.parametrize("rows_of", [
    lambda n, i: np.arange(i * n // 2, (i + 1) * n // 2),  # contiguous halves
    lambda n, i: np.concatenate([np.arange(n)[i * n // 4 : (i + 1) * n // 4],
                                 np.arange(n)[(i + 2) * n // 4 : (i + 3) * n // 4]]),  # 0,2 | 1,3
])  # fmt: skip
def test_two_data_shards_compose_the_one_process_batch(rows_of):
    c = _task_config(max_prompt_len=5)
    tok = data.build_char_tokenizer()
    single = tasks.build_task(c, tok)
    held_out_drops = single.start.dropped
    exchange = _Exchange(2)
    shards = [tasks.build_task(c, tok, shard=(i, 2), allgather=exchange.allgather(i))
              for i in range(2)]  # fmt: skip
    cursor, cursors = single.start, [task.start for task in shards]
    for n in (8, 16, 4, 8):
        want, cursor = single.next_train(n, cursor)
        got: list = [None, None]

        def read(i, n=n, got=got):
            got[i], cursors[i] = shards[i].next_train(n, cursors[i], rows=rows_of(n, i))

        threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        composed = [None] * n
        for i in range(2):
            for r, ex in zip(rows_of(n, i), got[i], strict=True):
                composed[r] = ex
        assert [ex["id"] for ex in composed] == [ex["id"] for ex in want]
        assert all(
            ex["prompt_ids"] == w["prompt_ids"] for ex, w in zip(composed, want, strict=True)
        )
        for shard_cursor in cursors:  # the data position (checkpointed by process 0) is global
            assert shard_cursor == cursor
    assert cursor.dropped > held_out_drops  # the batches had prompts to skip
