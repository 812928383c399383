"""Training on multi-turn rollouts with tools: the update sees the tools' answers (attention)
and counts the policy's tokens only (losses), packed as unpacked; config errors are one
sentence. The tiny random policy writes the bracket format's `]` now and then, so its rows call
the calculator (mostly with garbage: error observations) at random places."""

import jax
import numpy as np
import pytest

from gvpo_jax import assemble, buckets, data, train
from gvpo_jax import config as config_lib
from gvpo_jax import eval as eval_lib
from gvpo_jax.batch import UpdateBatch
from gvpo_jax.rl_step import rl_step
from gvpo_jax.rollout import collect_groups
from tests.test_buckets import full_logprobs, full_loss
from tests.test_train import _flat, make_run, toy_config

N = 24
TOOLS = {"tools.names": "calculator", "tools.format": "bracket", "tools.max_tokens": 6,
         "rollout.max_new_tokens": N, "rollout.prompts_per_step": 4}  # fmt: skip


def _tool_batch(run, state, seed=0):
    fresh, completions, _, metrics = collect_groups(
        run, state.params, assemble.start_loop(run), jax.random.key(seed), 4
    )
    return fresh, completions, metrics


def test_tool_answers_are_seen_and_not_counted():
    """A rollout's rows carry each answer after its call with attention 1 and loss mask 0, the
    sampler's log-probs are 0 there, the task scores the last turn, and the tools/* metrics
    count what happened; evaluation samples with the tools too; an RL step on it runs and
    moves the policy; a run of several processes is refused."""
    run, state, loop, ref = make_run(toy_config("gvpo", **TOOLS))
    close = run.tokenizer.convert_tokens_to_ids("]")
    scored, score = [], run.task.score
    run.task.score = lambda texts, golds: (scored.extend(texts), score(texts, golds))[1]
    fresh, completions, metrics = _tool_batch(run, state)
    J = run.config.data.max_prompt_len
    attn, resp, tokens = fresh["attn_mask"][:, J:], fresh["resp_mask"], fresh["tokens"][:, J:]
    tool = (attn > 0) & (resp == 0)
    assert tool.sum() >= 4  # several answers in the batch
    for b, t in zip(*np.nonzero(tool), strict=True):
        assert tool[b, t - 1] or tokens[b, t - 1] == close  # each answer follows its call
    assert np.all(fresh["rollout_logp"][tool] == 0) and np.all(fresh["behaviour_logp"][tool] == 0)
    first = np.flatnonzero(tool.any(1))[0]
    assert "]=" in completions[first]  # the logged text holds the whole exchange
    last = np.flatnonzero(tool[first])[-1] + 1  # the task scored the last turn alone
    ends = resp.sum(1).astype(int) + tool.sum(1)
    assert scored[first] == run.tokenizer.decode(tokens[first, last : ends[first]].tolist(),
                                                 skip_special_tokens=True)  # fmt: skip
    assert completions[first].endswith(scored[first]) and len(scored[first]) < len(
        completions[first]
    )
    assert metrics["tools/calls_per_response"] > 0 and 0 <= metrics["tools/failed_frac"] <= 1
    assert metrics["tools/turns_mean"] > 1 and 0 < metrics["tools/token_share"] < 1
    # Evaluation samples multi-turn too, and counts the calls.
    flat = eval_lib.evaluate_policy(
        run.model(state.params), run.task.eval_examples, tokenizer=run.tokenizer,
        settings=run.sampling, mesh=run.mesh, rules=run.rules, reward_fn=run.task.eval_reward,
        n=2, chunk=4, seed=0, num_workers=0, tools=run.tools,
    )  # fmt: skip
    assert flat["eval/tools/calls_per_response"] > 0  # the random policy's "]"s were answered
    assert 0 <= flat["eval/tools/greedy_failed_frac"] <= 1
    before = _flat(state.params)
    state, m, _, _ = rl_step(run, state, loop, ref)
    assert np.isfinite(m["loss"]) and np.abs(_flat(state.params) - before).max() > 0
    assert "tools/calls_per_response" in m
    # A run of several processes is refused (each process would decide its own turns).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(config_lib.ConfigError, match="2 processes"):
            assemble.tool_run(run.config, run.tokenizer, run.sampling)


def test_packed_update_equals_the_full_width_pass_with_tool_answers():
    """Packed micro-batches over rows holding tool answers (attention 1, loss 0) give the
    full-width pass's log-probs, loss and gradient; and changing an answer's token changes
    the later log-probs (attention reads it) while its own slot never reaches the loss."""
    changes = {**TOOLS, "optim.pack_groups": True, "optim.micro_batches": 2,
               "optim.length_buckets": 4}  # fmt: skip
    run, state, _, ref = make_run(toy_config("gvpo", **changes))
    fresh, _, _ = _tool_batch(run, state, seed=1)
    J = run.config.data.max_prompt_len
    tool = (fresh["attn_mask"][:, J:] > 0) & (fresh["resp_mask"] == 0)
    assert tool.sum() >= 4
    batch = UpdateBatch(tokens=fresh["tokens"], valid=fresh["attn_mask"],
                        loss_mask=fresh["resp_mask"], rewards=fresh["rewards"])  # fmt: skip
    full = full_logprobs(run, state.params, batch.tokens, batch.valid)
    batch = batch.replace(  # GVPO's reference and the sampler's own log-probs (0 on answers)
        ref_logp=full_logprobs(run, ref, batch.tokens, batch.valid),
        sampler_logp=fresh["rollout_logp"],
        drawn=np.ones(len(batch.rewards), np.float32),
    )
    packed = run.updater.logprobs(state.params, batch.tokens, batch.valid)
    np.testing.assert_allclose(packed, full, rtol=0, atol=1e-5)
    acc, _ = run.updater.accumulated(state.params, batch)
    (loss, _), grads = full_loss(run, state.params, batch)
    g_packed, g_full = _flat(acc["grads"]) / 2, _flat(grads)
    np.testing.assert_allclose(g_packed, g_full, rtol=0, atol=2e-5 * np.abs(g_full).max())
    np.testing.assert_allclose(float(acc["loss"]) / 2, float(loss), rtol=2e-5, atol=1e-7)
    # An answer token changed: later policy tokens read it, so their log-probs move.
    b, t = (int(i[0]) for i in np.nonzero(tool))
    assert batch.loss_mask[b, t + 1 :].sum() > 0
    tokens = batch.tokens.copy()
    tokens[b, J + t] = (tokens[b, J + t] + 1) % len(run.tokenizer)
    moved = full_logprobs(run, state.params, tokens, batch.valid)
    assert np.abs(moved[b, t + 1 :] - full[b, t + 1 :]).max() > 1e-6
    assert buckets.response_ends(batch.loss_mask)[b] >= t + 1


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"tools.names": "calculator,abacus"}, "abacus"),
        (
            {"tools.names": "calculator,python", "tools.format": "bracket"},
            "bracket format calls one",
        ),
        ({"tools.names": "calculator", "tools.format": "chat"}, "no chat template"),
        (
            {"tools.names": "calculator", "tools.format": "bracket", "tools.max_tokens": 8},
            "max_new_tokens",
        ),
        (
            {**TOOLS, "rollout.num_slots": 2},
            "num_slots",
        ),
        ({"tools.format": "smoke"}, "tools.format"),
        ({"tools.max_turns": 0}, "tools.max_turns"),
        (
            {
                "tools.names": "calculator",
                "tokenizer.kind": "hf",
                **{k: v for k, v in TOOLS.items() if k != "tools.format"},
            },
            "use_chat_template",
        ),
    ],
)
def test_bad_tool_configs_are_one_sentence(changes, words):
    c = toy_config()
    config_lib.set_fields(c, changes)
    with pytest.raises(config_lib.ConfigError, match=words):
        config_lib.validate(c, check_paths=False)


def test_sft_demonstrations_call_the_calculator_and_read_its_answer():
    """sft.tool_demos: a share of the problems (fixed per problem) is demonstrated as a call,
    the calculator's real answer (seen, not counted) and the answer; the rest answer directly."""
    arith = {"data.task": "arith", "data.arith.ops": "*", "data.max_prompt_len": 10}
    c = toy_config("gvpo", **TOOLS, **arith, **{"sft.tool_demos": 0.3})
    run, _, _, _ = make_run(c)
    arith = data.ArithTask(ops="*", max_operand=999)
    examples = [arith.example(a, "*", b) for a, b in ((417, 286), (12, 34), (5, 999))]
    examples += [arith.example(int(a), "*", int(b)) for a, b in np.arange(400).reshape(200, 2)]
    for ex in examples:
        ex["prompt_ids"] = run.tokenizer.encode(ex["prompt"])
    share = np.mean([train.calls_tool(ex, 0.3) for ex in examples])
    assert 0.2 < share < 0.4
    c.sft.tool_demos = 1.0
    rows = train.sft_batch(run, examples[:3])
    J = c.data.max_prompt_len
    tokens, resp, attn = rows["tokens"][:, J:], rows["resp_mask"], rows["attn_mask"][:, J:]
    text = run.tokenizer.decode(tokens[0][attn[0] > 0], skip_special_tokens=False)
    assert text == "[417*286]=119262 119262<eos>"
    seen = run.tokenizer.decode(tokens[0][(attn[0] > 0) & (resp[0] == 0)])
    assert seen == "=119262 "  # the calculator's answer: attention only
