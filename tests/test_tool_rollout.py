"""Multi-turn rollouts with tools (`gvpo_jax.multiturn`): a row stops at its tool-call stop
sequence, the host's answer is prefilled into the row's own cache columns, and decoding resumes.

The strongest check holds whatever the tokens: every log-prob the sampler returns for a policy
token equals a full forward over the prompt and the whole response (observations included), so
resuming from the cache reads exactly what a fresh forward would. The rest: observations land
after their call with mask 0, limits (turns, room, U) end rows as documented, rows do not depend
on each other, and a mesh returns the one-device output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gvpo_jax import decode, models, multiturn, sharding

CFG = models.ModelConfig(
    vocab_size=12,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
)
STOP, EOS = 5, 11
PROMPTS = [[3, 4, 6], [7, 8], [2, 2, 2, 2], [9]]
OBS = [9, 10, 11, 4]  # an observation holding the EOS id: only the policy's EOS ends a row


def _settings(n=24, g=2, stop=(STOP,), u=4, **kw):
    sampling = decode.SamplingSettings(
        max_new_tokens=n, group_size=g, eos_ids=(EOS,), temperature=1.0, **kw
    )
    return multiturn.TurnSettings(sampling=sampling, stop_ids=stop, max_tool_tokens=u)


def _model(seed=0):
    return models.Transformer(CFG, rngs=nnx.Rngs(seed))


def _run(model, settings, answer=None, prompts=PROMPTS, turns=3, seed=0, **kw):
    calls = []

    def default(text, room):
        calls.append((text, room))
        return OBS[:room], True

    return multiturn.sample_with_tools(
        model,
        prompts,
        settings=settings,
        answer=answer or default,
        decode_text=lambda ids: " ".join(map(str, ids)),
        rng=jax.random.key(seed),
        max_turns=turns,
        **kw,
    ), calls


def _full_logp(model, prompts, out, g):
    """log pi(token) of every response token from one full forward of prompt + response."""
    b, n = out.tokens_BxN.shape
    rows = []
    for i in range(b):
        p = prompts[i // g]
        seq = np.concatenate([p, out.tokens_BxN[i, : out.lengths_B[i]]]).astype(np.int32)
        logits = model(jnp.asarray(seq)[None])[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        got = np.zeros(n, np.float32)
        for t in range(out.lengths_B[i]):
            got[t] = logp[len(p) - 1 + t, seq[len(p) + t]]
        rows.append(got)
    return np.stack(rows)


def test_resumed_log_probs_equal_a_full_forward():
    """Rows that called tools several times: each policy token's log-prob equals the full
    forward's (the cache held the prompt, the earlier turns and the prefilled observations),
    every observation follows its call with mask 0, and nothing past a row's end is valid."""
    model = _model()
    settings = _settings()
    out, calls = _run(model, settings)
    assert out.calls_B.sum() >= 4 and out.turns_B.max() >= 3  # several multi-turn rows
    full = _full_logp(model, PROMPTS, out, g=2)
    pol = out.policy_BxN > 0
    np.testing.assert_allclose(out.logp_BxN[pol], full[pol], atol=2e-5)
    assert np.all(out.logp_BxN[~pol] == 0) and np.all(out.sample_logp_BxN[~pol] == 0)
    for b in range(out.tokens_BxN.shape[0]):
        n = out.lengths_B[b]
        toks, p = out.tokens_BxN[b, :n], out.policy_BxN[b, :n]
        assert np.all(out.valid_BxN[b, :n] == 1) and np.all(out.valid_BxN[b, n:] == 0)
        t, answered = 0, 0
        while t < n:  # walk the row: policy tokens, and after each stop token its observation
            assert p[t] == 1
            if toks[t] == STOP and t + 1 < n:
                k = 0
                while t + 1 + k < n and p[t + 1 + k] == 0:
                    k += 1
                assert 1 <= k <= len(OBS) and list(toks[t + 1 : t + 1 + k]) == OBS[:k]
                answered += 1
                t += 1 + k
            else:
                t += 1
        assert out.turns_B[b] == 1 + answered and out.tool_tokens_B[b] == n - p.sum()
    assert all(text.split()[-1] == str(STOP) for text, _ in calls)


def test_multi_token_stop_sequence_and_policy_only_matching():
    """A two-token stop sequence ends a turn only when the policy wrote both tokens: an
    observation ending in its first token followed by the policy's second does not."""
    model = _model(1)
    free, _ = _run(model, _settings(stop=(99,), n=32), turns=0)  # 99: no call ever
    pairs = {}
    for row, n in zip(free.tokens_BxN, free.lengths_B, strict=True):
        for t in range(n - 1):
            if row[t] != row[t + 1]:
                key = (int(row[t]), int(row[t + 1]))
                pairs[key] = pairs.get(key, 0) + 1
    stop = max(pairs, key=pairs.get)  # the policy's most frequent pair of distinct tokens
    obs = [stop[0]]  # the stop's first token

    out, _ = _run(model, _settings(stop=stop, n=32), answer=lambda t, room: (obs[:room], True))
    assert out.calls_B.sum() >= 2
    halves = 0
    for b in range(out.tokens_BxN.shape[0]):
        toks, pol, n = out.tokens_BxN[b], out.policy_BxN[b] > 0, out.lengths_B[b]
        for t in range(n - 2):
            if tuple(toks[t : t + 2]) == stop and pol[t] and pol[t + 1]:
                assert not pol[t + 2] and toks[t + 2] == obs[0]
            if not pol[t] and pol[t + 1] and tuple(toks[t : t + 2]) == stop:
                assert pol[t + 2]  # half in the observation: not a call
                halves += 1
    assert halves  # the case happened


def test_limits_end_rows():
    """max_turns: a call past it goes unanswered and ends the row; room: an observation is cut
    to the columns left (one kept for the policy), and a call with no room left ends the row;
    an answer of [] (nothing fits) ends the row."""
    model = _model()
    out, _ = _run(model, _settings(), turns=1)
    assert out.turns_B.max() == 2 and (out.calls_B > out.turns_B - 1).any()
    ended_on_call = out.calls_B > out.turns_B - 1
    for b in np.flatnonzero(ended_on_call):
        assert out.tokens_BxN[b, out.lengths_B[b] - 1] == STOP and out.truncated_B[b] == 1
    short, calls = _run(model, _settings(n=10))
    assert all(room <= 10 - 1 for _, room in calls)
    assert short.lengths_B.max() <= 10
    nothing, _ = _run(model, _settings(), answer=lambda text, room: ([], True))
    assert nothing.tool_tokens_B.sum() == 0 and np.all(nothing.turns_B == 1)
    called = nothing.calls_B > 0
    assert called.any()
    np.testing.assert_array_equal(nothing.tokens_BxN[called, nothing.lengths_B[called] - 1], STOP)


def test_rows_do_not_depend_on_each_other():
    """Token t of row b is drawn with its own key: a prompt's rows are the same beside other
    prompts (with other tool calls and lengths) as alone in their rows' places."""
    model = _model()
    out, _ = _run(model, _settings())
    other, _ = _run(model, _settings(), prompts=[PROMPTS[0], [1, 1, 1, 1, 1, 1, 1], [3], [4, 4]])
    for name in ("tokens_BxN", "policy_BxN", "lengths_B", "calls_B"):
        np.testing.assert_array_equal(getattr(out, name)[:2], getattr(other, name)[:2])
    np.testing.assert_allclose(out.logp_BxN[:2], other.logp_BxN[:2], atol=1e-5)


def test_errors_are_observations_and_failed_calls_counted():
    """An answer marked not ok (a tool error the model reads) is still an observation; it is
    counted in failed_B."""
    model = _model()
    out, _ = _run(model, _settings(), answer=lambda text, room: (OBS[:room], False))
    answered = out.turns_B - 1
    assert answered.sum() > 0
    np.testing.assert_array_equal(out.failed_B, answered)


def test_sharded_equals_one_device():
    """On a 4 x 2 mesh (rows over data, heads over tensor) the rows, their calls and log-probs
    equal the one-device rollout's."""
    mesh = sharding.make_mesh(4, 1, 2)
    rules = sharding.logical_rules(mesh, CFG)
    model = sharding.init_sharded(CFG, mesh, seed=0)
    graphdef, state = nnx.split(model)
    host = nnx.merge(graphdef, jax.device_put(jax.device_get(state), jax.devices()[0]))
    ref, _ = _run(host, _settings())
    out, _ = _run(model, _settings(), mesh=mesh, rules=rules)
    for name in ("tokens_BxN", "policy_BxN", "lengths_B", "calls_B", "turns_B"):
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name))
    np.testing.assert_allclose(out.logp_BxN, ref.logp_BxN, atol=1e-4)


@pytest.mark.parametrize("bad", [dict(stop_ids=()), dict(max_tool_tokens=0)])
def test_settings_refuse_bad_values(bad):
    kw = dict(sampling=decode.SamplingSettings(max_new_tokens=4), stop_ids=(1,), max_tool_tokens=2)
    with pytest.raises(ValueError, match=next(iter(bad))):
        multiturn.TurnSettings(**{**kw, **bad})
