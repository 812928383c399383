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


def _float_fields(c, prefix=""):
    """Dotted paths of every float field of a config (placeholders included)."""
    for key in c.keys():
        if isinstance(c[key], type(c)):
            yield from _float_fields(c[key], f"{prefix}{key}.")
        elif c.get_type(key) is float:
            yield f"{prefix}{key}"


FLOAT_FIELDS = sorted(_float_fields(config_lib.base_config()))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_every_float_field_must_be_finite(value):
    """nan passes every `< 0` check and inf every `> 0` one: the generic check refuses both in
    each float field (placeholders and model overrides included) before any other check."""
    assert len(FLOAT_FIELDS) > 15, FLOAT_FIELDS
    for path in [*FLOAT_FIELDS, "model.overrides.rope_theta"]:
        c = _arith()
        config_lib.set_fields(c, {path: value})
        with pytest.raises(config_lib.ConfigError) as err:
            config_lib.validate(c)
        text = str(err.value)
        assert text.startswith(f"config.{path} is {value}; set a finite number"), text
        assert text.count(". ") == 0 and text.endswith("."), text


MODEL_INVALID = [
    ({"model.overrides.num_kv_heads": 3}, "config.model.overrides give an invalid model: "
     "ModelConfig.num_heads=4 must be a multiple of num_kv_heads=3"),
    ({"model.overrides.hidden_size": 0}, "config.model.overrides give an invalid model: "
     "ModelConfig.hidden_size=0; use a positive integer."),
    ({"model.overrides.num_kv_heads": 0}, "ModelConfig.num_kv_heads=0; use a positive integer."),
    ({"model.overrides.sliding_window": "2"}, "ModelConfig.sliding_window='2'; use an integer"),
    ({"model.overrides.rope_theta": 0.0}, "ModelConfig.rope_theta=0.0; use a finite number > 0."),
    ({"model.overrides.hidden_sise": 64}, "config.model.overrides.hidden_sise is not a "
     "ModelConfig field; did you mean 'hidden_size'?"),
    ({"model.preset": "tiny", "model.overrides.num_heads": 3},
     "config.model.overrides on model.preset='tiny' give an invalid model: ModelConfig.num_heads"),
    ({"tokenizer.kind": "model"}, "config.tokenizer.kind is 'model' but the model is built from "
     "model.preset / model.overrides, which hold no tokenizer"),
    ({"rollout.staleness": 201}, "config.rollout.staleness is 201 but the run has only 200 RL "
     "steps (train.steps)"),
    ({"rollout.shed": 1, "rollout.num_slots": 64}, "config.rollout.shed is 1 with "
     "rollout.num_slots 64 (continuous batching"),
]  # fmt: skip


@pytest.mark.parametrize("changes,message", MODEL_INVALID, ids=[m[:40] for _, m in MODEL_INVALID])
def test_model_and_rollout_settings_fail_in_one_sentence(changes, message):
    c = _arith()
    config_lib.set_fields(c, changes)
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.validate(c)
    assert message in str(err.value) and str(err.value).count(". ") == 0, str(err.value)


def test_bounds_that_validate():
    """The edges of the new bounds are valid: a lag of the whole run, shedding the static batch
    (num_slots = P x G is the static batch too), overrides without a vocab_size."""
    for changes in (
        {"rollout.staleness": 200},
        {"rollout.shed": 2},
        {"rollout.shed": 2, "rollout.num_slots": 128 * 4},
        {"mode": "eval", "rollout.staleness": 300},
    ):
        c = _arith()
        config_lib.set_fields(c, changes)
        config_lib.validate(c)
    del c.model.overrides["head_dim"]
    with pytest.raises(config_lib.ConfigError, match="sets no head_dim and there is no"):
        config_lib.validate(c)


def test_config_json_fields_are_checked_by_name():
    """A config.json whose shape fields are zero, of the wrong JSON type, or not an object is
    one sentence naming the file and the field, never a ZeroDivisionError or TypeError."""
    from gvpo_jax import models

    good = models.config_to_hf(models.PRESETS["tiny"])
    cases = [
        ({"hidden_size": 0}, "config.json: 'hidden_size' is 0; set the model's positive integer"),
        ({"num_attention_heads": 0}, "'num_attention_heads' is 0"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' is 0"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers' is '2'"),
        ({"intermediate_size": 1.5}, "'intermediate_size' is 1.5"),
        ({"rope_theta": float("nan"), "rope_parameters": None}, "ModelConfig.rope_theta=nan"),
        ({"rms_norm_eps": [1e-6]}, "config.json has a field of the wrong type (TypeError"),
        ({"rope_parameters": "default"}, "config.json has a field of the wrong type"),
    ]
    for changes, message in cases:
        with pytest.raises(models.CheckpointError) as err:
            models.config_from_hf({**good, **changes}, source="d/config.json")
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(models.CheckpointError, match="holds a JSON list, not an object"):
        models.config_from_hf([good])


def test_tokenizer_past_the_embedding_is_refused_but_unused_special_tokens_pass():
    """Ids past the model's vocabulary would read the embedding's last row; a special token up
    there that the run never feeds (as Gemma 3's image token) is allowed."""
    from gvpo_jax.data import char_tokenizer

    c = _arith()
    tok = char_tokenizer.build_char_tokenizer()
    config_lib.check_vocab(c, len(tok), tok)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    config_lib.check_vocab(c, len(tok) - 1, tok)
    tok.add_tokens(["<word>"])
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.check_vocab(c, len(tok) - 2, tok)
    n = len(tok)
    assert str(err.value).startswith(
        f"the character tokenizer (tokenizer.kind=char) has token id {n - 1} past the model's "
        f"embedding table of {n - 2} rows"
    ), str(err.value)


def test_a_data_file_that_does_not_decode_is_named(tmp_path):
    """A loader's reason that does not name the file (a UnicodeDecodeError) gets
    config.data.path in the sentence."""
    from gvpo_jax import tasks
    from gvpo_jax.data import char_tokenizer

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "answer": "2\xff"}\n')
    c = _arith()
    c.data.task, c.data.path = "jsonl", str(bad)
    config_lib.validate(c)
    with pytest.raises(tasks.DataError) as err:
        tasks.build_task(c, char_tokenizer.build_char_tokenizer())
    text = str(err.value)
    assert f"could not be loaded from config.data.path {str(bad)!r}: 'utf-8' codec" in text, text
    assert "\n" not in text and text.endswith(".") and not text.endswith(".."), text
