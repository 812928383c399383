"""Trainer wiring: config fields and fault paths that `train.run` must honour, seen in its outputs.

Each test checks one thing the trainer has to connect (a config field reaching the loss or the
optimizer, a signal reaching the checkpointer, a checkpoint reaching the replay buffer, ...) on
what a run writes: metrics.jsonl, Orbax checkpoints, the exported model. A handful of tiny runs
(8 fake CPU devices, 1-layer model) are shared by module-scoped fixtures; the suite's persistent
compilation cache (conftest.py) makes repeated runs of one config cheap.

The run's step is read from metrics.jsonl by rewards registered here (the `wiring_*` rewards),
which is how a SIGTERM or a poisoned gradient lands on a chosen step without patching the loop.
Package internals are touched only by the helpers in the first section (port those when the
trainer is restructured).
"""

import json
import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import transformers
from safetensors.numpy import load_file

from gvpo_jax import assemble, data, losses, rewards, sampler, sharding, train
from gvpo_jax import config as config_lib
from gvpo_jax.replay import ReplayBuffer
from tests.helpers import PROGRAM_COUNTS

# ----------------------------------------------------------------------------------------------
# Helpers that reach package internals (the only ones; port these after the restructure).


def sample_on_meshes(config, prompts, seed, meshes):
    """`sampler.sample_groups` as the trainer calls it, once per mesh, with one policy: built on
    the first mesh (assemble.build_model) and moved onto each of the others."""
    tok = data.build_char_tokenizer()
    model, tok, _ = assemble.build_model(config, tok, meshes[0])
    settings = assemble.sampling_settings(config, tok)
    outs = []
    for mesh in meshes:
        rules = sharding.logical_rules(mesh, model.config)
        placed = sharding.shard_model(model, mesh, rules)
        out = sampler.sample_groups(
            placed, prompts, settings=settings, rng=jax.random.key(seed), mesh=mesh, rules=rules
        )
        outs.append(jax.tree.map(np.asarray, out))
    return outs


def poison_gradients(monkeypatch, marker: float) -> None:
    """Updates whose rewards all equal `marker` get NaN gradients and an unchanged, finite loss.

    Wraps `losses.preset_loss` (what the RL loss calls): sqrt'(0) * 0 = inf * 0 = NaN in the
    backward pass, while sqrt(x) - stop_gradient(sqrt(x)) adds exactly 0 to the value.
    """
    real = losses.preset_loss

    def poisoned(name, *, logp, rewards, **kw):
        loss, aux = real(name, logp=logp, rewards=rewards, **kw)
        x = jnp.where(jnp.all(rewards == marker), 0.0, 1.0) + 0.0 * jnp.sum(logp)
        return loss + (jnp.sqrt(x) - jax.lax.stop_gradient(jnp.sqrt(x))), aux

    monkeypatch.setattr(losses, "preset_loss", poisoned)


def record_replay_states(monkeypatch) -> dict[str, list]:
    """Copies of the replay buffer's state each time it is saved (`state_dict`) and right after
    each restore (`load_state_dict`)."""
    seen = {"saved": [], "restored": []}
    state_dict, load_state_dict = ReplayBuffer.state_dict, ReplayBuffer.load_state_dict

    def copy(state):
        return {k: np.array(v, copy=True) for k, v in state.items()}

    def saving(self):
        state = state_dict(self)
        seen["saved"].append(copy(state))
        return state

    def loading(self, state):
        load_state_dict(self, state)
        seen["restored"].append(copy(state_dict(self)))

    monkeypatch.setattr(ReplayBuffer, "state_dict", saving)
    monkeypatch.setattr(ReplayBuffer, "load_state_dict", loading)
    return seen


# ----------------------------------------------------------------------------------------------
# Outputs of a run: metrics.jsonl, Orbax checkpoints, the exported model.

# Wall-clock metrics and the programs a run meets differ between identical runs.
VOLATILE = ("time", "tokens_per_s", *PROGRAM_COUNTS)
# Every compilation starts by lowering to MLIR, also when the persistent compilation cache (the
# suite runs with one, see conftest.py) then supplies the executable.
COMPILE_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def rl_rows(workdir) -> dict[int, dict]:
    """RL metric rows of metrics.jsonl by step; for a step written twice, the last row."""
    path = os.path.join(workdir, "metrics.jsonl")
    rows = {}
    if os.path.exists(path):
        for line in open(path):
            row = json.loads(line)
            if "reward_mean" in row:
                rows[row["step"]] = row
    return rows


def step_in_progress(workdir) -> int:
    """The RL step running now: one more than the steps whose metrics row is written."""
    return 1 + len(rl_rows(workdir))


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.endswith("_s") and k not in VOLATILE}


def read_checkpoint(workdir, step: int) -> dict:
    """Items of <workdir>/checkpoints/<step> read with Orbax alone (no target): {"state": train
    state as nested dicts, "ref": reference params or None, "meta": dict, "replay": arrays}."""
    handlers = {
        "state": ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
        "replay_spec": ocp.JsonCheckpointHandler(),
        "replay": ocp.StandardCheckpointHandler(),
    }
    options = ocp.CheckpointManagerOptions(read_only=True)
    path = os.path.join(workdir, "checkpoints")
    with ocp.CheckpointManager(path, options=options, item_handlers=handlers) as manager:
        items = {"state": ocp.args.StandardRestore(), "meta": ocp.args.JsonRestore()}
        if manager.item_metadata(step).get("replay") is not None:
            items["replay"] = ocp.args.StandardRestore()
        out = manager.restore(step, args=ocp.args.Composite(**items))
    tree = jax.tree.map(np.asarray, dict(out["state"]))
    replay = dict(out["replay"]) if "replay" in items else {}
    return {"state": tree["state"], "ref": tree.get("ref"), "meta": dict(out["meta"]),
            "replay": jax.tree.map(np.asarray, replay)}  # fmt: skip


def checkpoint_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "checkpoints")
    return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def flat(tree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


# ----------------------------------------------------------------------------------------------
# Rewards that know the run's step (from metrics.jsonl) and act on it.

CLOCK = {"workdir": None, "sigterm_at": None, "poison_at": (), "signalled": []}
POISON = 0.25  # a constant-reward run gets this reward on poisoned steps (and NaN gradients)


def _exact_or_sigterm(completion, gold, timeout_s=None):
    """Exact match; sends SIGTERM to this process once, while scoring step CLOCK["sigterm_at"]."""
    step = step_in_progress(CLOCK["workdir"])
    if step == CLOCK["sigterm_at"] and not CLOCK["signalled"]:
        CLOCK["signalled"].append(step)
        os.kill(os.getpid(), signal.SIGTERM)
    return 1.0 if completion.strip() == gold.strip() else 0.0


def _has_seven(completion, gold, timeout_s=None):
    """A binary reward a random policy earns now and then (so accuracy = mean task reward)."""
    return 1.0 if "7" in completion else 0.0


def _constant_or_poison(completion, gold, timeout_s=None):
    """0.5 for everything (zero advantages), POISON on the steps in CLOCK["poison_at"]."""
    return POISON if step_in_progress(CLOCK["workdir"]) in CLOCK["poison_at"] else 0.5


PROBE_REWARDS = {"wiring_exact": _exact_or_sigterm, "wiring_has7": _has_seven,
                 "wiring_const": _constant_or_poison}  # fmt: skip


@pytest.fixture(scope="module")
def probes():
    for name, fn in PROBE_REWARDS.items():
        rewards.register(rewards.Reward(name, fn))
    yield CLOCK
    for name in PROBE_REWARDS:
        rewards.REWARDS.pop(name)


def wiring_config(algo="gvpo", **changes):
    """A tiny run on the arithmetic task: 1-layer model, one group per device of the mesh."""
    c = config_lib.base_config()
    c.model.overrides.update(dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  head_dim=16, intermediate_size=64))  # fmt: skip
    c.model.logprob_chunk = 8
    c.algo.name = algo
    c.data.arith.max_operand = 9  # "<bos>9+9=": 5 prompt tokens
    c.data.arith.ops = "+"
    c.data.max_prompt_len = 8
    c.data.eval_size = 8
    # 8 or 16 prompts per rollout (the fake mesh has 8 data shards) and G = 2 in every run: the
    # sampler then compiles for two shapes in the whole module.
    c.rollout.prompts_per_step = 16
    c.rollout.group_size = 2
    c.rollout.max_new_tokens = 4
    c.algo.overlong_cache = 2
    c.train.eval_every = 0
    c.train.sample_log_every = 0
    c.train.export = False
    c.train.plot = False
    config_lib.set_fields(c, changes)
    config_lib.validate(c)
    return c


def eval_steps(workdir) -> list[int]:
    """Steps of the evaluation rows of metrics.jsonl, in the order written (a run evaluates at
    its start step: 0, or the step it resumed from)."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [row["step"] for row in rows if "eval/greedy" in row]


# ----------------------------------------------------------------------------------------------
# GVPO with anchor="ref", demonstrations and replay: a straight run (compilations counted per
# step), and the same run preempted by SIGTERM at step 3, then resumed.

GVPO_STEPS, PREEMPT_AT = 5, 3


def gvpo_config():
    return wiring_config(
        "gvpo",
        **{
            "algo.anchor": "ref",
            "algo.demo_slot": True,
            "algo.replay_fraction": 0.5,
            "algo.replay_capacity": 16,  # full after step 1 (16 fresh groups), fifo after
            "data.rewards": "wiring_exact:1",
            "optim.lr": 1e-2,
            "train.steps": GVPO_STEPS,
            "train.checkpoint_every": 100,  # no scheduled save: a preemption save is the only one
            "train.export": True,
            "train.compile_ahead": "true",
        },
    )


@pytest.fixture(scope="module")
def gvpo_runs(tmp_path_factory, probes):
    c = gvpo_config()
    root = tmp_path_factory.mktemp("gvpo")
    straight, preempted = root / "straight", root / "preempted"
    compiles = []  # the RL step in progress at each compilation of the straight run

    def listener(event, duration, **kw):
        if event == COMPILE_EVENT:
            compiles.append(step_in_progress(straight))

    CLOCK.update(workdir=straight, sigterm_at=None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        train.run(c, str(straight))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)

    # SIGTERM while step 3 is scored. A fallback handler keeps pytest alive if the trainer's
    # own handler is missing (the test then fails on the missing checkpoint instead).
    CLOCK.update(workdir=preempted, sigterm_at=PREEMPT_AT, signalled=[])
    unhandled = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: unhandled.append(signum))
    try:
        with pytest.MonkeyPatch.context() as mp:
            replay_states = record_replay_states(mp)
            summary = train.run(c, str(preempted))
            steps_after_preemption = checkpoint_steps(preempted)
            CLOCK.update(sigterm_at=None)
            resumed_summary = train.run(c, str(preempted))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return dict(
        config=c, straight=straight, preempted=preempted, compiles=compiles,
        preempted_summary=summary, steps_after_preemption=steps_after_preemption,
        signalled=list(CLOCK["signalled"]), unhandled=unhandled,
        resumed_summary=resumed_summary, replay_states=replay_states,
    )  # fmt: skip


def test_anchor_ref_measures_the_log_ratio_to_the_frozen_start(gvpo_runs):
    """GVPO's var_term is beta^2/2 x the within-group variance of log pi_theta/pi_anchor: 0 at
    step 1 (the policy is still its start), > 0 once the policy has moved away from the frozen
    reference. With the rollout policy as the anchor it would stay 0 at every step."""
    rows = rl_rows(gvpo_runs["straight"])
    assert sorted(rows) == list(range(1, GVPO_STEPS + 1))
    assert abs(rows[1]["var_term"]) < 1e-10 and abs(rows[1]["log_ratio_mean"]) < 1e-6
    for step in range(2, GVPO_STEPS + 1):
        assert rows[step]["var_term"] > 1e-6, (step, rows[step]["var_term"])
        assert rows[step]["skipped_updates"] == 0


def test_demonstration_fills_the_last_slot_of_every_group(gvpo_runs):
    c = gvpo_runs["config"]
    G, Tp = c.rollout.group_size, c.data.max_prompt_len
    rows = rl_rows(gvpo_runs["straight"])
    for step, row in rows.items():
        # The demonstration always answers; `accuracy` is the sampled responses' alone: with 0/1
        # rewards, reward_mean x G = (G - 1) x accuracy + demo_accuracy (one demo per group).
        assert row["demo_accuracy"] == 1.0, step
        sampled_acc = (row["reward_mean"] * G - 1.0) / (G - 1)
        assert row["accuracy"] == pytest.approx(sampled_acc, abs=1e-6), step
    # The replay buffer in the final checkpoint holds the last steps' groups with their rewards.
    replay = read_checkpoint(gvpo_runs["straight"], GVPO_STEPS)["replay"]
    tok = transformers.AutoTokenizer.from_pretrained(str(gvpo_runs["straight"] / "tokenizer"))
    tokens, attn = replay["group_tokens"], replay["group_attn_mask"]
    resp_mask, group_rewards = replay["group_resp_mask"], replay["group_rewards"]
    assert tokens.shape[:2] == (c.algo.replay_capacity, G)
    for g in range(tokens.shape[0]):
        for i in range(G):
            prompt = tok.decode(tokens[g, i, :Tp][attn[g, i, :Tp] > 0], skip_special_tokens=True)
            a, b = prompt.rstrip("=").split("+")
            response = tokens[g, i, Tp:][resp_mask[g, i] > 0]
            text = tok.decode(response, skip_special_tokens=True)
            assert group_rewards[g, i] == float(text.strip() == str(int(a) + int(b)))
            if i == G - 1:  # the demonstration: the gold answer, then EOS
                assert text == str(int(a) + int(b)), (prompt, text)
                assert response[-1] == tok.eos_token_id
                assert group_rewards[g, i] == 1.0


def test_sampler_consistency_metric_ignores_demonstrations(gvpo_runs):
    """Demonstration rows were never sampled (rollout_logp = 0): the sampler-vs-recompute gap
    and the entropy estimate cover the sampled responses only."""
    for step, row in rl_rows(gvpo_runs["straight"]).items():
        assert row["sampler_logp_gap_max"] < 1e-4, (step, row["sampler_logp_gap_max"])


def test_sigterm_saves_the_step_it_lands_on_and_resumes_to_the_same_result(gvpo_runs):
    assert gvpo_runs["signalled"] == [PREEMPT_AT] and not gvpo_runs["unhandled"]
    assert gvpo_runs["preempted_summary"].get("preempted_at") == PREEMPT_AT
    # checkpoint_every=100 saves nothing before the end: step 3 is there because of the signal.
    assert gvpo_runs["steps_after_preemption"] == [PREEMPT_AT]
    assert read_checkpoint(gvpo_runs["preempted"], PREEMPT_AT)["meta"]["step"] == PREEMPT_AT
    # The second run resumed there: its start-of-training evaluation is at step 3.
    assert eval_steps(gvpo_runs["preempted"]) == [0, PREEMPT_AT, GVPO_STEPS]
    assert "preempted_at" not in gvpo_runs["resumed_summary"]
    a = load_file(str(gvpo_runs["straight"] / "export" / "model.safetensors"))
    b = load_file(str(gvpo_runs["preempted"] / "export" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    rows_a, rows_b = rl_rows(gvpo_runs["straight"]), rl_rows(gvpo_runs["preempted"])
    assert sorted(rows_b) == list(range(1, GVPO_STEPS + 1))
    for step in range(1, GVPO_STEPS + 1):
        assert stable(rows_a[step]) == stable(rows_b[step]), step
    assert rows_b[GVPO_STEPS]["replayed_groups"] == 8.0  # replay was in play across the resume


def test_replay_buffer_restored_from_a_checkpoint_equals_the_saved_one(gvpo_runs):
    saved, restored = gvpo_runs["replay_states"]["saved"], gvpo_runs["replay_states"]["restored"]
    # Saved at the preemption (step 3) and at the end of the resumed run; restored once.
    assert len(saved) == 2, "the replay buffer was not saved at the preemption and at the end"
    assert len(restored) == 1, "the resumed run did not load the replay buffer"
    before, after = saved[0], restored[0]
    assert int(before["counters"][0]) == 16  # a full buffer, not a trivial one
    assert sorted(before) == sorted(after)
    for k in before:
        assert before[k].dtype == after[k].dtype, k
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_no_compilation_once_the_replay_buffer_is_full(gvpo_runs):
    """Step 1 samples 16 fresh groups, step 2 the first 8 fresh + 8 replayed (new shapes: a
    compile); from step 3 on every shape is fixed, so nothing may compile again."""
    by_step = {s: gvpo_runs["compiles"].count(s) for s in range(1, GVPO_STEPS + 2)}
    assert by_step[1] > 0  # the listener does see compilations
    assert all(by_step[s] == 0 for s in range(3, GVPO_STEPS + 1)), by_step
    # The run compiles its update and log-prob programs ahead (train.compile_ahead), and each
    # step's metrics count the programs it met for the first time: the sampler's at step 1 and
    # at step 2 (fewer fresh prompts), none after. A program the first step reaches before its
    # compile has started (a slow or busy host) is compiled by the step instead, and counted.
    rows = rl_rows(gvpo_runs["straight"])
    ahead, first = rows[1]["programs_compiled_ahead"], rows[1]["programs_reached_first"]
    assert ahead >= 1 and ahead + first == 4  # zeros, accumulate, apply, log-probs
    assert rows[1]["new_programs"] > 0 and rows[2]["new_programs"] > 0
    assert all(rows[s]["new_programs"] == 0 for s in range(3, GVPO_STEPS + 1)), rows


# ----------------------------------------------------------------------------------------------
# Two DAPO runs with the same loss and optimizer settings, so the update compiles once for both
# (persistent cache): eps overrides 0 / 0, AdamW with weight decay and a cosine schedule over 6
# updates, and NaN gradients for updates whose rewards all equal POISON.
#  - "shaping": a 0/1 reward and a linear overlong window, two passes per batch (3 x 2 updates);
#  - "faults": a constant reward and no overlong penalty (zero advantages, so zero gradients: only
#    the weight decay moves the parameters), poisoned on steps 2, 4 and 5 (6 x 1 updates), so it
#    stops at step 5 (max_bad_steps=2).

N_TOKENS, OVERLONG_FACTOR = 4, 0.5
OPT = dict(lr=5e-4, weight_decay=10.0, updates=6)


def cosine_lr(t: int) -> float:
    """optim.schedule="cosine": the peak lr decaying to 0.1 x peak over the run's updates."""
    return OPT["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / OPT["updates"])))


def dapo_config(**changes):
    return wiring_config(
        "dapo",
        **{
            "algo.eps_low": 0.0,  # clip on any move: the preset's 0.2 / 0.28 would not, here
            "algo.eps_high": 0.0,
            "rollout.max_new_tokens": N_TOKENS,
            "optim.lr": OPT["lr"],
            "optim.schedule": "cosine",
            "optim.weight_decay": OPT["weight_decay"],
            **changes,
        },
    )


@pytest.fixture(scope="module")
def poisoned_loss():
    with pytest.MonkeyPatch.context() as mp:
        poison_gradients(mp, POISON)
        yield


@pytest.fixture(scope="module")
def shaping_rows(tmp_path_factory, probes, poisoned_loss):
    c = dapo_config(
        **{
            "algo.num_epochs": 2,  # the second pass sees ratios != 1
            "algo.overlong_cache": N_TOKENS - 1,  # the window covers every length >= 1: linear
            "algo.overlong_factor": OVERLONG_FACTOR,
            "data.rewards": "wiring_has7:1",
            "train.steps": OPT["updates"] // 2,
        }
    )
    workdir = tmp_path_factory.mktemp("shaping")
    train.run(c, str(workdir))
    return rl_rows(workdir)


def test_eps_overrides_reach_the_clipped_loss(shaping_rows):
    assert len(shaping_rows) == OPT["updates"] // 2
    for step, row in shaping_rows.items():
        # Ratios stay well inside the preset's clip range [0.8, 1.28]: the metrics are means over
        # both passes of each pass's min / max, and the first pass's ratios are 1, so the second
        # pass's lie in [2 ratio_min - 1, 2 ratio_max - 1]. Only eps = 0 can clip here.
        assert 0.91 < row["ratio_min"] <= row["ratio_max"] < 1.09, step
        assert row["clip_frac_low"] > 0 and row["clip_frac_high"] > 0, step


def test_dapo_overlong_penalty_is_added_to_the_rewards(shaping_rows):
    """With the window covering lengths 1..N the penalty is -factor (L - 1) / (N - 1) for every
    response, so the shaped reward mean is the task reward mean minus factor (mean L - 1) / (N-1);
    the task reward is 0/1, so its mean is the accuracy metric."""
    for step, row in shaping_rows.items():
        penalty = OVERLONG_FACTOR * (row["response_len_mean"] - 1) / (N_TOKENS - 1)
        assert penalty > 0.1, step  # responses are long enough for the check to mean something
        assert row["reward_mean"] == pytest.approx(row["accuracy"] - penalty, abs=1e-5), step


@pytest.fixture(scope="module")
def faults(tmp_path_factory, probes, poisoned_loss):
    c = dapo_config(
        **{
            "algo.overlong_factor": 0.0,
            "algo.dynamic_sampling": False,
            "data.rewards": "wiring_const:1",
            "train.steps": OPT["updates"],
            "train.max_bad_steps": 2,
            "train.checkpoint_every": 1,
            "train.keep_checkpoints": 10,
        }
    )
    workdir = tmp_path_factory.mktemp("faults")
    CLOCK.update(workdir=workdir, poison_at=(2, 4, 5))
    error = None
    try:
        train.run(c, str(workdir))
    except Exception as e:  # noqa: BLE001 - the tests say which error was expected
        error = e
    finally:
        CLOCK.update(poison_at=())
    steps = checkpoint_steps(workdir)
    ckpts = {s: read_checkpoint(workdir, s) for s in steps}
    # The trainer's own restore of what is left: mode=eval resumes from the latest checkpoint
    # and evaluates there.
    evaluate = c.copy_and_resolve_references()
    evaluate.mode = "eval"
    train.run(evaluate, str(workdir))
    return dict(error=error, steps=steps, ckpts=ckpts, rows=rl_rows(workdir),
                eval_steps=eval_steps(workdir))  # fmt: skip


def test_nonfinite_gradient_with_finite_loss_is_skipped(faults):
    rows, ckpts = faults["rows"], faults["ckpts"]
    assert rows[2]["skipped_updates"] == 1
    assert rows[2]["loss"] == 0.0 and rows[2]["grad_norm"] is None  # finite loss, NaN gradient
    assert rows[1]["skipped_updates"] == 0 and rows[3]["skipped_updates"] == 0
    p1, p2, p3 = (flat(ckpts[s]["state"]["params"]) for s in (1, 2, 3))
    for name in p1:
        np.testing.assert_array_equal(p2[name], p1[name], err_msg=name)  # step 2 changed nothing
    assert any(not np.array_equal(p3[k], p2[k]) for k in p2)  # and step 3 went on
    assert [int(ckpts[s]["state"]["updates"]) for s in (1, 2, 3)] == [1, 1, 2]  # updates applied
    assert [int(ckpts[s]["state"]["bad_steps"]) for s in (1, 2, 3)] == [0, 1, 0]


def test_max_bad_steps_stops_the_run_and_keeps_the_last_good_checkpoint(faults):
    assert isinstance(faults["error"], train.TrainingError), faults["error"]
    assert str(faults["error"]).startswith("step 5: 2 consecutive non-finite updates")
    assert faults["steps"] == [1, 2, 3, 4]  # nothing was saved for the failing step 5
    assert sorted(faults["rows"]) == [1, 2, 3, 4, 5]  # but its metrics were logged
    assert faults["rows"][5]["skipped_updates"] == 1 and faults["rows"][5]["grad_norm"] is None
    last = faults["ckpts"][4]
    assert last["meta"]["step"] == 4
    assert int(last["state"]["updates"]) == 2 and int(last["state"]["bad_steps"]) == 1
    params = flat(last["state"]["params"])
    assert all(np.isfinite(v).all() for v in params.values())
    before = flat(faults["ckpts"][3]["state"]["params"])
    for name in params:  # the skipped step 4 saved the parameters of step 3
        np.testing.assert_array_equal(params[name], before[name], err_msg=name)
    # The trainer restores it: mode=eval on the workdir evaluates at step 4.
    assert faults["eval_steps"] == [0, 4]


def test_cosine_schedule_and_weight_decay_reach_the_optimizer(faults):
    """Zero gradients leave AdamW only its decoupled decay: p <- p (1 - lr_t wd) exactly, with
    lr_t the schedule at the number of updates applied so far (skipped steps do not count)."""
    rows, ckpts = faults["rows"], faults["ckpts"]
    updates_before = {1: 0, 2: 1, 3: 1, 4: 2}  # steps 2 and 4 were skipped
    for step, t in updates_before.items():
        assert rows[step]["lr"] == pytest.approx(cosine_lr(t), rel=1e-6), step
        assert rows[step]["grad_norm"] in (0.0, None), step  # zero advantages: no gradient
    p2, p3 = flat(ckpts[2]["state"]["params"]), flat(ckpts[3]["state"]["params"])
    shrink = 1.0 - cosine_lr(1) * OPT["weight_decay"]
    for name in p2:
        np.testing.assert_allclose(p3[name], p2[name] * shrink, rtol=2e-6, atol=0, err_msg=name)


# ----------------------------------------------------------------------------------------------
# Sampling through the trainer's rollout path on a mesh.


def test_sampled_rollout_on_a_mesh_equals_one_device():
    """Temperature 1, same key: the 8-device mesh the trainer builds samples exactly the tokens
    a one-device mesh does (rows split over devices must not change any row's random draws)."""
    c = wiring_config()
    assert c.rollout.temperature == 1.0 and c.rollout.top_p == 1.0 and c.rollout.top_k == 0
    tok = data.build_char_tokenizer()
    prompts = [tok.encode(f"{i % 10}+{i // 2}=") for i in range(c.rollout.prompts_per_step)]
    devices = jax.devices()
    assert len(devices) == 8
    meshes = [sharding.make_mesh(-1, 1, 1), sharding.make_mesh(1, 1, 1, devices=devices[:1])]
    many, one = sample_on_meshes(c, prompts, seed=3, meshes=meshes)
    np.testing.assert_array_equal(many.tokens_BxN, one.tokens_BxN)
    np.testing.assert_array_equal(many.lengths_B, one.lengths_B)
    np.testing.assert_array_equal(many.mask_BxN, one.mask_BxN)
    np.testing.assert_allclose(many.logp_BxN, one.logp_BxN, atol=1e-5)
    groups = one.tokens_BxN.reshape(len(prompts), c.rollout.group_size, -1)
    assert sum(len({tuple(r) for r in g}) > 1 for g in groups) > len(groups) // 2  # sampled
