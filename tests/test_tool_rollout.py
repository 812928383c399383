"""Multi-turn rollouts with tools (`gvpo_jax.multiturn`): a row stops at its tool-call stop
sequence, the host's answer is prefilled into the row's own cache columns, and decoding resumes.

The strongest check holds whatever the tokens: every log-prob the sampler returns for a policy
token equals a full forward over the prompt and the whole response (observations included), so
resuming from the cache reads exactly what a fresh forward would. The rest: observations land
after their call with mask 0, limits (turns, room, U) end rows as documented, rows do not depend
on each other, and a mesh returns the one-device output.
"""

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from gvpo_jax import decode, models, multiturn, sharding, tools
from gvpo_jax.tools import formats
from tests.helpers import qwen_char_tokenizer

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


def _settings(n=24, g=2, stop=(STOP,), u=4, chunk=0, **kw):
    sampling = decode.SamplingSettings(
        max_new_tokens=n, group_size=g, eos_ids=(EOS,), temperature=1.0, **kw
    )
    return multiturn.TurnSettings(sampling=sampling, stop_ids=stop, max_tool_tokens=u, chunk=chunk)


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
    """log pi(token) of every response token from one full forward of prompt + response (the
    rows right-padded into one jitted batch)."""
    b, n = out.tokens_BxN.shape
    seqs = [
        np.concatenate([prompts[i // g], out.tokens_BxN[i, : out.lengths_B[i]]]) for i in range(b)
    ]
    width = max(len(x) for x in seqs)
    tokens = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), bool)
    for i, x in enumerate(seqs):
        tokens[i, : len(x)], mask[i, : len(x)] = x, True
    logp = np.asarray(jax.jit(lambda t, m: jax.nn.log_softmax(model(t, None, m), -1))(tokens, mask))
    got = np.zeros((b, n), np.float32)
    for i in range(b):
        p = len(prompts[i // g])
        for t in range(out.lengths_B[i]):
            got[i, t] = logp[i, p - 1 + t, tokens[i, p + t]]
    return got


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
    assert any(room < 4 for _, room in calls)  # answers cut to the columns left
    assert short.lengths_B.max() <= 10 and short.tool_tokens_B.max() > 0
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


def test_a_hanging_tool_fails_its_call_and_the_rollout_goes_on():
    """A call whose answer does not come within timeout_s reads the late observation and is
    counted failed; the rollout does not wait for it (the thread is released at the end)."""
    release, hung = threading.Event(), []

    def answer(text, room):
        if not hung:  # the first call hangs
            hung.append(text)
            release.wait(60)
        return OBS[:room], True

    t0 = time.perf_counter()
    try:
        out = multiturn.sample_with_tools(
            _model(), PROMPTS, settings=_settings(), answer=answer,
            decode_text=lambda ids: " ".join(map(str, ids)), rng=jax.random.key(0),
            max_turns=3, timeout_s=0.5, late=lambda room, why: [7][:room] if "0.5 s" in why else [],
        )  # fmt: skip
    finally:
        release.set()
    assert time.perf_counter() - t0 < 30
    late_rows = [b for b in range(len(out.lengths_B)) if out.failed_B[b]]
    assert len(late_rows) >= 1 and out.failed_B.sum() <= out.turns_B.sum()
    b = late_rows[0]
    pol, toks = out.policy_BxN[b], out.tokens_BxN[b]
    first_obs = int(np.argmax((pol == 0) & (out.valid_BxN[b] > 0)))
    assert toks[first_obs - 1] == STOP and toks[first_obs] == 7 and pol[first_obs + 1] == 1


def test_prefill_takes_only_the_prompts_and_the_answers(monkeypatch):
    """The programs prefill the prompts once (start) and then each turn's answers alone, U wide
    (resume): the answers' tokens fed in all turns are exactly the rollout's tool tokens, so
    nothing already decoded is prefilled again."""
    starts, fed = [], []
    real_start, real_resume = multiturn.start, multiturn.resume

    def start(graphdef, state, ids, lens, rng, **kw):
        starts.append(np.asarray(lens).copy())
        return real_start(graphdef, state, ids, lens, rng, **kw)

    def resume(graphdef, state, ts, forced, forced_len, finish, **kw):
        assert np.asarray(forced).shape[1] == kw["settings"].max_tool_tokens
        fed.append(np.asarray(forced_len).copy())
        return real_resume(graphdef, state, ts, forced, forced_len, finish, **kw)

    monkeypatch.setattr(multiturn, "start", start)
    monkeypatch.setattr(multiturn, "resume", resume)
    out, _ = _run(_model(), _settings())
    assert len(starts) == 1 and list(starts[0]) == [len(p) for p in PROMPTS]
    assert len(fed) >= 2 and sum(int(f.sum()) for f in fed) == out.tool_tokens_B.sum() > 0


def test_a_tiny_qwen3_through_qwen3s_chat_template_end_to_end():
    """A random Qwen3 policy with the chat format: its rows stop at </tool_call>, each answer
    is the registry's (an error for its garbage JSON) in Qwen3's frame, the prompt and every
    turn's tokens are exactly the whole conversation rendered at once, and the scored text is
    the last turn."""
    tok = qwen_char_tokenizer()
    fmt = formats.ChatFormat(tok, tools.Registry([tools.calculator]))
    cfg = models.ModelConfig(
        architecture="qwen3", vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=64, qk_norm=True, attention_bias=False,
    )  # fmt: skip
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    question = [{"role": "user", "content": "What is 6*7?"}]
    sampling = decode.SamplingSettings(
        max_new_tokens=320, group_size=8, eos_ids=(tok.eos_token_id,), pad_id=0
    )
    run = multiturn.Tools(
        multiturn.TurnSettings(sampling=sampling, stop_ids=fmt.stop_ids, max_tool_tokens=200),
        fmt,
        max_turns=3,
    )
    out = run.sample(model, [fmt.prompt_ids(question)], tokenizer=tok, rng=jax.random.key(1))
    assert out.calls_B.sum() >= 2
    starts, checked, answered = multiturn.final_turns(out), 0, 0
    for b in range(8):
        n, pol, toks = out.lengths_B[b], out.policy_BxN[b], out.tokens_BxN[b]
        ended = n < 320 and toks[n - 1] == tok.eos_token_id
        if not ended:
            continue  # a cut row: its conversation has no end to render
        messages, t = list(question), 0
        while t < n:  # policy turns, each followed by its answer
            end = t
            while end < n and pol[end] == 1:
                end += 1
            text = tok.decode(toks[t:end].tolist())
            if end == n:  # the last turn: its EOS is the template's <|im_end|>
                messages.append({"role": "assistant", "content": text[: -len("<|im_end|>")]})
                assert tok.decode(toks[starts[b] : n].tolist(), skip_special_tokens=True) == (
                    tok.decode(toks[t : n - 1].tolist(), skip_special_tokens=True)
                )
                break
            obs_end = end
            while obs_end < n and pol[obs_end] == 0:
                obs_end += 1
            answer = fmt.registry.call_json(fmt.call(text))
            assert not answer.ok and toks[end - 1] == fmt.stop_ids[-1]
            assert list(toks[end:obs_end]) == fmt.observation_ids(answer.text)
            messages += [{"role": "assistant", "content": text},
                         {"role": "tool", "content": answer.text}]  # fmt: skip
            t, answered = obs_end, answered + 1
        whole = tok.apply_chat_template(
            messages, tools=fmt.registry.schemas(), chat_template=fmt.template, tokenize=False
        )
        assert fmt.prompt_ids(question) + list(toks[:n]) + fmt.encode("\n") == fmt.encode(whole)
        checked += 1
    assert checked >= 3 and answered >= 1


def test_chunks_let_rows_decode_while_tools_run_and_sample_the_same():
    """With chunk = 3 the programs return every 3 decode steps: rows that called wait for
    their answers (here 20 ms each) while the others go on, answers join at a chunk boundary,
    and every row is the one the unchunked rollout samples (its tokens are keyed by row and
    position, whatever the schedule)."""

    def slow(text, room):
        time.sleep(0.02)
        return OBS[:room], True

    ref, _ = _run(_model(), _settings(), answer=slow)
    out, _ = _run(_model(), _settings(chunk=3), answer=slow)
    for name in ("tokens_BxN", "policy_BxN", "lengths_B", "calls_B", "turns_B"):
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name))
    np.testing.assert_allclose(out.logp_BxN, ref.logp_BxN, atol=1e-5)
    assert out.calls_B.sum() >= 4 and ref.tool_wait_s > 0


def test_answers_that_come_back_together_resume_in_one_program(monkeypatch):
    """No row running (chunk 0: every row called or ended in the first program): once the first
    answer is back the device also waits for the others while they keep coming (each within
    `GATHER_S` of the last), so every waiting row resumes in one program, not one program per
    straggler. Each answer here is 20 ms late plus 1 ms per call before it; the window is widened
    to 0.5 s so that a loaded machine's thread scheduling (CI runs two test workers on two
    cores) cannot split answers 1 ms apart. With the window at 0 the first resume takes one."""
    waiting, resumed = [], []
    real_start, real_resume = multiturn.start, multiturn.resume
    order, lock = [], threading.Lock()

    def start(*args, **kw):
        ts = real_start(*args, **kw)
        waiting.append(int(np.sum(np.asarray(ts.status_B) == multiturn.WAITING)))
        return ts

    def resume(graphdef, state, ts, forced, forced_len, finish, **kw):
        resumed.append(int(np.sum(np.asarray(forced_len) > 0)))
        return real_resume(graphdef, state, ts, forced, forced_len, finish, **kw)

    def late(text, room):
        with lock:
            order.append(text)
            k = len(order)
        time.sleep(0.02 + 0.001 * k)
        return OBS[:room], True

    monkeypatch.setattr(multiturn, "start", start)
    monkeypatch.setattr(multiturn, "resume", resume)
    monkeypatch.setattr(multiturn, "GATHER_S", 0.5)
    _run(_model(), _settings(), answer=late)
    assert waiting[0] >= 3, waiting  # several rows called in the first program
    assert resumed[0] == waiting[0], (waiting, resumed)
