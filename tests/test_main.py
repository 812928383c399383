"""The entry point end to end: the default config runs, writes its outputs, and the export loads."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from gvpo_jax import config as config_lib
from gvpo_jax import models
from tests.conftest import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo") / "run"
    cmd = [
        sys.executable, "-m", "gvpo_jax.main", "--config=configs/arith_tiny.py",
        f"--workdir={workdir}", "--config.sft.steps=20", "--config.train.steps=4",
        "--config.train.eval_every=2", "--config.data.eval_size=16",
        "--config.train.checkpoint_every=2", "--config.train.sample_log_every=2",
        "--config.algo.beta=0.2",
    ]  # fmt: skip
    # One CPU device, as `make demo` runs (the suite's 8 fake devices split 128 prompts 8 ways
    # on 2 cores; the trainer on a mesh is tested in test_wiring / test_multiprocess).
    env = child_env()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return workdir, proc


@pytest.mark.slow
def test_demo_exits_0_and_prints_accuracies(demo_run):
    _, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "eval_before_sft:" in out and "eval_start:" in out and "eval_end:" in out
    assert "[rl] step 4/4" in out


@pytest.mark.slow
def test_demo_writes_metrics_plot_checkpoint_and_samples(demo_run):
    workdir, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    rl = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    for key in (
        "loss",
        "grad_norm",
        "response_len_mean",
        "rollout_time_s",
        "logprob_time_s",
        "update_time_s",
        "d_abs_mean",
    ):
        assert all(np.isfinite(r[key]) for r in rl), key
    # arith_tiny evaluates avg@16 at T=1 and greedy accuracy, both logged at every evaluation.
    evals = [r for r in rows if "eval/greedy" in r]
    assert len(evals) >= 4 and all(0.0 <= r["eval/avg@16"] <= 1.0 for r in evals)
    png = workdir / "curves.png"
    assert png.stat().st_size > 5000 and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    assert (workdir / "samples.jsonl").stat().st_size > 0
    # Overrides reached the run: the resolved config is saved in the workdir.
    saved = json.load(open(workdir / "config.json"))
    assert saved["train"]["steps"] == 4 and saved["algo"]["beta"] == 0.2
    summary = json.load(open(workdir / "summary.json"))
    assert 0.0 <= summary["eval_end"] <= 1.0 and 0.0 <= summary["eval_end_greedy"] <= 1.0


@pytest.mark.slow
def test_demo_export_loads_in_transformers(demo_run):
    torch = pytest.importorskip("torch")
    import transformers

    workdir, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = str(workdir / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = tok("12+7=", return_tensors="pt").input_ids
    ours = models.from_pretrained(export)
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
    got = np.asarray(ours(jax.numpy.asarray(ids.numpy(), jax.numpy.int32)))
    np.testing.assert_allclose(got, ref, atol=1e-4)


# Bad command lines from a new user's battery: each is one sentence on stderr and exit status 2.
BAD_OVERRIDES = [
    ("--config.data.rewards=nosuch:1", "error: config.data.rewards is 'nosuch:1': unknown reward "
     "'nosuch'; registered rewards: math, format, think_format, exact_match, last_number."),
    ("--config.data.rewards=math:abc", "error: config.data.rewards is 'math:abc': the weight "
     "'abc' of math is not a finite number;"),
    ("--config.algo.betta=0.2", "error: unknown config field 'algo.betta'; did you mean "
     "'algo.beta'?"),
    ("--config.train.reward_workers=auto", "error: config.train.reward_workers cannot be 'auto'"),
]  # fmt: skip


def test_bad_overrides_exit_2_with_one_sentence(tmp_path):
    procs = [  # in parallel: each spends its ~2 s importing
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gvpo_jax.main",
                "--config=configs/arith_tiny.py",
                f"--workdir={tmp_path / str(i)}",
                override,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i, (override, _) in enumerate(BAD_OVERRIDES)
    ]
    for proc, (override, sentence) in zip(procs, BAD_OVERRIDES, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (override, err[-3000:])
        assert err.strip().startswith(sentence) and "\n" not in err.strip(), (override, err)
        assert err.strip()[len("error: ") :].count(". ") == 0, err
    assert not any(tmp_path.iterdir()), "nothing may be written before the command line is valid"


def test_qwen_math_validates_and_has_7b_shapes():
    from configs import qwen_math

    c = qwen_math.get_config()
    config_lib.validate(c, check_paths=False)  # the weights live on the training machine
    assert (c.algo.name, c.algo.beta, c.rollout.group_size, c.optim.lr) == ("gvpo", 0.1, 4, 1e-6)
    assert c.rollout.prompts_per_step == 1024 and c.algo.num_minibatches == 4
    abstract = models.abstract_model(models.PRESETS[c.model.preset])
    assert models.param_count(abstract) == 7_615_616_512
    with pytest.raises(config_lib.ConfigError, match="config.model.hf_dir"):
        config_lib.validate(c)  # with path checks on, the missing local weights are reported
