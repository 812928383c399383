"""Config validation: each invalid setting fails with one sentence naming the field."""

import os
import subprocess
import sys

import pytest

from gvpo_jax import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _arith():
    sys.path.insert(0, REPO)
    from configs import arith_tiny

    return arith_tiny.get_config()


INVALID = [
    ("mode", "fly", "config.mode is 'fly'"),
    ("algo.name", "ppo", "config.algo.name is 'ppo'"),
    ("rollout.group_size", 1, "config.rollout.group_size is 1"),
    ("rollout.prompts_per_step", 0, "config.rollout.prompts_per_step is 0"),
    ("algo.num_minibatches", 3, "config.algo.num_minibatches=3 does not divide"),
    ("optim.micro_batches", 5, "config.optim.micro_batches=5 does not divide"),
    ("rollout.temperature", 0.0, "config.rollout.temperature is 0.0"),
    ("rollout.top_p", 1.5, "config.rollout.top_p is 1.5"),
    ("rollout.top_k", -1, "config.rollout.top_k is -1"),
    ("rollout.num_slots", -1, "config.rollout.num_slots is -1; set it to an integer >= 0"),
    ("rollout.num_slots", 10**6, "config.rollout.num_slots is 1000000 but a rollout has only"),
    ("optim.length_buckets", -1, "config.optim.length_buckets is -1; set it to an integer >= 0"),
    ("optim.length_buckets", 10**6, "config.optim.length_buckets is 1000000 but responses have"),
    ("train.eval_num_slots", -4, "config.train.eval_num_slots is -4; set it to an integer >= 0"),
    ("train.eval_chunk", -4, "config.train.eval_chunk is -4; set it to an integer >= 0"),
    ("model.attention", "flash", "config.model.attention is 'flash'; use one of auto, dense"),
    ("algo.beta", 0.0, "config.algo.beta is 0.0"),
    ("algo.anchor", "new", "config.algo.anchor is 'new'"),
    ("algo.replay_fraction", 1.0, "config.algo.replay_fraction is 1.0"),
    ("model.param_dtype", "float16", "config.model.param_dtype is 'float16'"),
    ("model.compute_dtype", "float16", "config.model.compute_dtype is 'float16'"),
    ("train.export_dtype", "fp8", "config.train.export_dtype is 'fp8'"),
    ("model.preset", "gpt5", "config.model.preset is 'gpt5'"),
    ("model.hf_dir", "/nonexistent/dir", "config.model.hf_dir '/nonexistent/dir' has no config"),
    ("data.task", "chess", "config.data.task is 'chess'"),
    ("data.on_too_long", "truncate", "config.data.on_too_long is 'truncate'"),
    ("optim.lr", -1.0, "config.optim.lr and config.sft.lr must be > 0"),
    ("optim.schedule", "step", "config.optim.schedule is 'step'"),
    ("train.reward_timeout_s", 0.0, "config.train.reward_timeout_s is 0.0"),
    ("mesh.fsdp", 0, "config.mesh.fsdp is 0"),
    ("mesh.distributed", "maybe", "config.mesh.distributed is 'maybe'"),
    ("tokenizer.kind", "bpe", "config.tokenizer.kind is 'bpe'"),
    ("algo.overlong_cache", 50, "config.algo.overlong_cache is 50"),
    ("train.max_bad_steps", 0, "config.train.max_bad_steps is 0"),
    ("algo.entropy_coef", -0.01, "config.algo.entropy_coef is -0.01; use 0 (off) or a positive"),
    ("algo.name", "ppo2", "use one of gvpo, grpo, dr_grpo, dapo, gspo, gspo_token, cispo, gmpo"),
    ("train.reward_workers", -2, "config.train.reward_workers is -2"),
    ("data.rewards", "nosuch:1", "unknown reward 'nosuch'; registered rewards: math, format"),
    ("data.rewards", "math:abc", "config.data.rewards is 'math:abc': the weight 'abc' of math"),
    ("data.rewards", "math:1,,:2", "unknown reward ''"),
]

# Settings that are only invalid together with another one.
INCONSISTENT = [
    ({"algo.name": "grpo", "algo.replay_fraction": 0.5}, "'grpo': its clipped or importance-w"),
    ({"algo.name": "cispo", "algo.replay_fraction": 0.5}, "'cispo': its clipped or importance"),
    ({"algo.name": "dapo", "algo.demo_slot": True}, "config.algo.demo_slot needs algo.name=gvpo"),
    ({"algo.name": "rloo", "algo.demo_slot": True}, "rloo's ratios assume the rollout policy"),
    (
        {"algo.name": "gmpo", "algo.kl_coef": 0.1},
        "config.algo.kl_coef is set but algo.name='gmpo' has no such setting; leave it unset or "
        "use one of grpo, dr_grpo, dapo, cispo, rloo, reinforce_pp, reinforce_pp_baseline",
    ),
    (
        {"algo.name": "grpo", "algo.reward_kl_coef": 0.1},
        "use one of reinforce_pp, reinforce_pp_baseline",
    ),
    ({"algo.name": "gvpo", "algo.eps_high": 0.28}, "algo.name='gvpo' has no such setting"),
    ({"data.task": "gsm8k", "data.path": ""}, "config.data.path is empty"),
    ({"mode": "sft", "sft.steps": 0}, "config.sft.steps is 0 but config.mode is 'sft'"),
    ({"train.steps": 0, "sft.steps": 0}, "are both 0"),
    ({"model.dtype": "bfloat16"}, r"config.model.dtype no longer exists; set model.param_dtype"),
    ({"algo.betta": 0.2}, "unknown config field 'algo.betta'; did you mean 'algo.beta'"),
    ({"model.param_dtype": "bfloat16"}, "config.model.param_dtype is bfloat16 for training"),
    (
        {"model.param_dtype": "bfloat16", "mode": "sft", "sft.steps": 2},
        "set model.allow_bf16_params=True",
    ),
]


def _set(c, path, value):
    *parents, leaf = path.split(".")
    for p in parents:
        c = c[p]
    c[leaf] = value


def test_default_config_validates():
    config_lib.validate(_arith())


@pytest.mark.parametrize("path,value,message", INVALID, ids=[x[0] for x in INVALID])
def test_invalid_field_names_field_and_fix(path, value, message):
    c = _arith()
    _set(c, path, value)
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.validate(c)
    text = str(err.value)
    assert message in text
    assert text.count(". ") == 0 and text.endswith("."), f"not one sentence: {text}"


@pytest.mark.parametrize("changes,message", INCONSISTENT, ids=[m for _, m in INCONSISTENT])
def test_inconsistent_settings_fail(changes, message):
    c = _arith()
    for path, value in changes.items():
        _set(c, path, value)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(c)


@pytest.mark.parametrize(
    "override,message",
    [
        ("--config.algo.name=ppo", "config.algo.name is 'ppo'"),
        ("--config.rollout.group_size=1", "config.rollout.group_size is 1"),
        ("--config.algo.num_minibatches=3", "does not divide"),
    ],
)
def test_cli_exits_2_before_compiling(tmp_path, override, message):
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gvpo_jax.main",
            "--config=configs/arith_tiny.py",
            f"--workdir={workdir}",
            override,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not workdir.exists(), "nothing may be written before validation passes"


def test_reward_settings_that_validate():
    for rewards, workers in [("math:1,format:0.1", -1), ("exact_match", 0), ("", 4)]:
        c = _arith()
        c.data.rewards, c.train.reward_workers = rewards, workers
        config_lib.validate(c)


@pytest.mark.parametrize(
    "override,sentence",
    [
        ("--config.algo.betta=0.2", "unknown config field 'algo.betta'; did you mean 'algo.beta'?"),
        (
            "--noconfig.train.plott",
            "unknown config field 'train.plott'; did you mean 'train.plot'?",
        ),
        ("--config.algoo.beta=1", "unknown config field 'algoo.beta'; did you mean 'algo'?"),
        (
            "--config.mesh.zzz=1",
            "unknown config field 'mesh.zzz'; config.mesh has coordinator_address, data,",
        ),
        ("--config.algo.beta.x=1", "config.algo.beta is a value, not a group of fields"),
        ("--config.model.dtype=bfloat16", "config.model.dtype no longer exists; set model.para"),
    ],
)
def test_unknown_override_field_gets_the_closest_name(override, sentence):
    argv = ["main.py", "--config=configs/arith_tiny.py", override]
    text = config_lib.flag_error_sentence([a.replace("configs/", REPO + "/configs/") for a in argv],
                                          KeyError("from ml_collections"))  # fmt: skip
    assert text.startswith(sentence) and text.count(". ") == 0, text


def test_bf16_parameters_validate_with_the_opt_in_or_outside_training():
    c = _arith()
    c.model.param_dtype, c.model.allow_bf16_params = "bfloat16", True
    config_lib.validate(c)
    c = _arith()
    c.model.param_dtype, c.mode = "bfloat16", "eval"  # no updates: bf16 storage is just storage
    config_lib.validate(c)
    c = _arith()
    c.model.compute_dtype = "bfloat16"  # fp32 masters + bf16 compute: the recommended setting
    config_lib.validate(c)
