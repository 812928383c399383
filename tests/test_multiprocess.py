"""Multi-host: a real 2-process CPU run (jax.distributed + gloo) against one device, and the
launch scripts' --dry-run output."""

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import mp_worker

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
    first), then greedy sampling."""
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
    assert "failed" in out.stderr and "[p0]" in out.stdout + out.stderr


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
        assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in words
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
