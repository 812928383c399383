"""The entry point end to end: the default config runs, writes its outputs, and the export loads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from gvpo_jax import config as config_lib
from gvpo_jax import models, programs
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
        "--config.model.overrides.num_layers=1",  # compile time grows with the layer count
    ]  # fmt: skip
    # One CPU device, as `make demo` runs (the suite's 8 fake devices split 128 prompts 8 ways
    # on 2 cores; the trainer on a mesh is tested in test_wiring / test_multiprocess). One layer
    # of the demo's three, as the resume tests run it: the same programs, a third of the depth.
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
# An entry is one argument or several; {inputs} is a directory of damaged files (`bad_inputs`).
BAD_OVERRIDES = [
    ("--config.data.rewards=nosuch:1", "error: config.data.rewards is 'nosuch:1': unknown reward "
     "'nosuch'; registered rewards: math, format, think_format, exact_match, last_number."),
    ("--config.data.rewards=math:abc", "error: config.data.rewards is 'math:abc': the weight "
     "'abc' of math is not a finite number;"),
    ("--config.algo.betta=0.2", "error: unknown config field 'algo.betta'; did you mean "
     "'algo.beta'?"),
    ("--config.train.reward_workers=auto", "error: config.train.reward_workers cannot be 'auto'"),
    ("--config.lora.alpha=inf", "error: config.lora.alpha is inf; set a finite number such as "
     "its default 32.0."),
    ("--config.rollout.staleness=201", "error: config.rollout.staleness is 201 but the run has "
     "only 200 RL steps (train.steps)"),
    (("--config.rollout.shed=1", "--config.rollout.num_slots=64"), "error: config.rollout.shed "
     "is 1 with rollout.num_slots 64 (continuous batching"),
    ("--config.model.overrides.num_kv_heads=3", "error: config.model.overrides give an invalid "
     "model: ModelConfig.num_heads=4 must be a multiple of num_kv_heads=3"),
    ("--config.model.hf_dir={inputs}/badjson", "error: {inputs}/badjson/config.json is not valid "
     "JSON (Expecting property name enclosed in double quotes at line 1, column 25)"),
    ("--config.model.hf_dir={inputs}/zero", "error: {inputs}/zero/config.json: 'hidden_size' is "
     "0; set the model's positive integer"),
    (("--config.model.hf_dir={inputs}/notok", "--config.tokenizer.kind=model"), "error: "
     "config.model.hf_dir '{inputs}/notok' holds no tokenizer files"),
    (("--config.tokenizer.kind=hf", "--config.tokenizer.path={inputs}/badtok"), "error: the "
     "tokenizer file {inputs}/badtok/tokenizer.json (config.tokenizer.path) is not valid JSON"),
    ("--config={inputs}/syntax.py", "error: the config file {inputs}/syntax.py has a syntax "
     "error at line 1"),
]  # fmt: skip


def tiny_hf_dir(directory) -> str:
    """A Hugging Face directory of a tiny Qwen2 model: config.json and zero weights, no tokenizer
    files."""
    from gvpo_jax.models import safetensors_io

    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(models.config_to_hf(cfg), f)
    zeros = [(m.hf_name, m.hf_shape, np.float32, lambda m=m: np.zeros(m.hf_shape, np.float32))
             for m in models.tensor_maps(cfg)]  # fmt: skip
    safetensors_io.write_file(Path(directory) / "model.safetensors", zeros)
    return str(directory)


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """Damaged files a run reads: config.json not JSON or with a zero width, an hf_dir without
    tokenizer files, a tokenizer.json not JSON, a config file that is not Python."""
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text('{"model_type": "qwen2", ')
    (root / "zero").mkdir()
    good = models.config_to_hf(models.PRESETS["tiny"])
    (root / "zero" / "config.json").write_text(json.dumps({**good, "hidden_size": 0}))
    tiny_hf_dir(root / "notok")
    (root / "badtok").mkdir()
    (root / "badtok" / "tokenizer.json").write_text('{"version": ')
    (root / "syntax.py").write_text("def get_config(:\n")
    return root


def _cli(workdir, args) -> list[str]:
    """The trainer's command line with `args` (after configs/arith_tiny.py unless they name a
    config file)."""
    config = (
        [] if any(a.startswith("--config=") for a in args) else ["--config=configs/arith_tiny.py"]
    )
    return [sys.executable, "-m", "gvpo_jax.main", *config, f"--workdir={workdir}", *args]


def test_bad_overrides_exit_2_with_one_sentence(tmp_path, bad_inputs):
    cases = [
        ([a.format(inputs=bad_inputs) for a in ((o,) if isinstance(o, str) else o)],
         sentence.format(inputs=bad_inputs))
        for o, sentence in BAD_OVERRIDES
    ]  # fmt: skip
    procs = [  # in parallel: each spends its ~2 s importing
        subprocess.Popen(
            _cli(tmp_path / str(i), args),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i, (args, _) in enumerate(cases)
    ]
    for proc, (args, sentence) in zip(procs, cases, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, err[-3000:])
        assert err.strip().startswith(sentence) and "\n" not in err.strip(), (args, err)
        assert err.strip()[len("error: ") :].count(". ") == 0, err
    assert not any(tmp_path.iterdir()), "nothing may be written before the command line is valid"


def test_tokenizer_faults_found_at_assembly_end_before_anything_compiles(tmp_path):
    """Ids past the model's vocabulary (a 352-token tokenizer on the 256-row tiny preset) and a
    tokenizer.json that transformers cannot load: one sentence and exit 2 once the tokenizer is
    loaded, before the model is initialised or any step compiles."""
    from gvpo_jax.data import char_tokenizer

    big = char_tokenizer.build_char_tokenizer()
    big.add_tokens([f"<w{i}>" for i in range(300)])
    big.save_pretrained(str(tmp_path / "bigtok"))
    (tmp_path / "badtok").mkdir()
    (tmp_path / "badtok" / "tokenizer.json").write_text("{}")
    cases = [
        (("--config.model.preset=tiny", "--config.tokenizer.kind=hf",
          f"--config.tokenizer.path={tmp_path / 'bigtok'}"),
         f"error: the tokenizer of config.tokenizer.path '{tmp_path / 'bigtok'}' has 96 token ids "
         "(256 to 351) past the model's embedding table of 256 rows (its vocab_size)"),
        (("--config.tokenizer.kind=hf", f"--config.tokenizer.path={tmp_path / 'badtok'}"),
         f"error: the tokenizer in config.tokenizer.path '{tmp_path / 'badtok'}' could not be "
         "loaded ("),
    ]  # fmt: skip
    for i in range(len(cases)):  # a workdir resumed with a bad tokenizer keeps its own record
        (tmp_path / f"run{i}").mkdir()
        (tmp_path / f"run{i}" / "config.json").write_text('{"earlier": "run"}')
    procs = [
        subprocess.Popen(
            _cli(tmp_path / f"run{i}", args),
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i, (args, _) in enumerate(cases)
    ]
    for i, (proc, (args, sentence)) in enumerate(zip(procs, cases, strict=True)):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (args, err[-3000:])
        assert err.strip().startswith(sentence) and "\n" not in err.strip(), (args, err)
        assert "model:" not in out, out  # the model is never built
        assert not (tmp_path / f"run{i}" / "checkpoints").exists()
        assert (tmp_path / f"run{i}" / "config.json").read_text() == '{"earlier": "run"}'


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


def test_tune_gc_freezes_what_is_alive_and_collects_the_young_generation_less_often():
    code = (
        "import gc; from gvpo_jax import programs; assert gc.get_freeze_count() == 0; "
        "programs.tune_gc(); print(gc.get_threshold(), gc.get_freeze_count())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    threshold, frozen = proc.stdout.rsplit(")", 1)
    assert threshold + ")" == str(programs.GC_THRESHOLDS) and int(frozen) > 10_000
