"""mode=eval holds the policy alone: a training checkpoint's parameters, cast once to the compute
dtype, without its Adam moments or reference copy; and a SIGTERM during the evaluation of the
paper's sets loses at most the set in progress."""

import gc
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.numpy import load_file

from tests.conftest import child_env
from tests.test_eval_sets import eval_config, fixture_dirs  # noqa: F401 (a fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Wide enough that the parameters (0.96 M, 3.9 MB in fp32) dwarf the other live arrays.
WIDE = {"model.overrides.hidden_size": 256, "model.overrides.intermediate_size": 1024,
        "model.overrides.num_heads": 4, "model.overrides.head_dim": 64}  # fmt: skip


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def test_eval_restores_params_only_in_the_compute_dtype(tmp_path, fixture_dirs, monkeypatch):  # noqa: F811
    """A checkpoint written by training (AdamW moments and a reference inside) is evaluated
    with the parameters alone, cast to bf16: no moments are built before the restore, and the
    live arrays during the evaluation come to about half the fp32 parameters, not the ~3.5x
    that masters + moments + reference make."""
    from gvpo_jax import assemble, train
    from gvpo_jax import eval as eval_lib

    root = os.path.dirname(fixture_dirs["amc"])
    common = {**WIDE, "eval.sets": "", "data.eval_size": 4, "data.max_prompt_len": 8,
              "model.compute_dtype": "bfloat16", "algo.anchor": "ref"}  # fmt: skip
    trained = str(tmp_path / "trained")
    train.run(eval_config(root, **common, mode="sft", **{"sft.steps": 1}), trained)
    step_dir = os.path.join(trained, "checkpoints", "0")  # SFT saves as RL step 0
    stored = ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))
    assert stored["ref"] is not None and stored["state"]["opt_state"]  # what is left on disk
    fp32_params = sum(np.asarray(x).nbytes for x in jax.tree.leaves(stored["state"]["params"]))
    assert fp32_params > 3.5e6

    seen = {}
    real = eval_lib.evaluate_policy

    def spy(model, *args, **kw):
        params = nnx.state(model, nnx.Param)
        seen["dtypes"] = {str(x.dtype) for x in jax.tree.leaves(params)}
        seen["params"] = params
        seen["live"] = _live_bytes() - before
        return real(model, *args, **kw)

    real_assemble = assemble.assemble

    def assemble_spy(*args, **kw):  # what the run holds before a checkpoint is read
        out = real_assemble(*args, **kw)
        seen["assembled"] = _live_bytes() - before
        return out

    monkeypatch.setattr(eval_lib, "evaluate_policy", spy)
    monkeypatch.setattr(assemble, "assemble", assemble_spy)
    before = _live_bytes()
    train.run(eval_config(root, **common, restore_from=trained), str(tmp_path / "eval"))
    # The initial parameters (fp32, replaced by the checkpoint's) and no Adam moments (2x more).
    assert 0.95 * fp32_params < seen["assembled"] < 1.25 * fp32_params
    assert seen["dtypes"] == {"bfloat16"}
    assert 0.45 * fp32_params < seen["live"] < 0.75 * fp32_params, (seen["live"], fp32_params)
    want = jax.tree.leaves(stored["state"]["params"])
    got = jax.tree.leaves(seen["params"])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w).astype(g.dtype))

    # mode=export reads the same parameters-only way and writes what the training run exported.
    exported = str(tmp_path / "exported")
    train.run(eval_config(root, **common, mode="export", restore_from=trained), exported)
    a = load_file(os.path.join(trained, "export", "model.safetensors"))
    b = load_file(os.path.join(exported, "export", "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


_KILLED_AT_SECOND_SET = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from gvpo_jax import eval as eval_lib, train
from tests.test_eval_sets import eval_config
real, calls = eval_lib.evaluate_policy, []
def evaluate_policy(*args, **kw):
    calls.append(1)
    if len(calls) == 2:  # the second set has started: the scheduler preempts us
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kw)
eval_lib.evaluate_policy = evaluate_policy
train.run(eval_config({root!r}), {workdir!r})
"""


def test_sigterm_loses_at_most_the_set_in_progress(tmp_path, fixture_dirs):  # noqa: F811
    """SIGTERM while the second set (amc) is evaluated: the process ends, the finished set's file
    is whole, nothing of amc is written; the rerun keeps aime24, evaluates the other four and
    writes the same table as an evaluation that was never interrupted."""
    from gvpo_jax import train
    from gvpo_jax.data import eval_sets

    root = os.path.dirname(fixture_dirs["amc"])
    workdir = str(tmp_path / "killed")
    script = _KILLED_AT_SECOND_SET.format(repo=REPO, root=root, workdir=workdir)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    out = os.path.join(workdir, "eval")
    assert sorted(os.listdir(out)) == ["aime24.json"]  # no amc, no temporary file, no table
    first = json.load(open(os.path.join(out, "aime24.json")))
    assert len(first["outcomes"]) == 3 and first["protocol"]["n"] == 32

    table = train.run(eval_config(root), workdir)
    assert json.load(open(os.path.join(out, "aime24.json"))) == first  # kept, not rerun
    assert sorted(os.listdir(out)) == sorted(
        [f"{n}.json" for n in eval_sets.EVAL_SETS] + ["table.json", "table.md"]
    )
    clean = train.run(eval_config(root), str(tmp_path / "clean"))
    assert table == clean
