"""Evaluation metrics: pass@k and maj@k against hand-computed values, avg@n on a known policy,
and the sampling keys of `evaluate_policy` (one per chunk)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from gvpo_jax import eval as eval_lib

HUGE_POWER = r"\boxed{9^{9^{9^{9}}}}"


@pytest.mark.parametrize(
    "n,c,k,expected",
    [(5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 2, 3, 0.9), (5, 2, 4, 1.0), (10, 0, 3, 0.0),
     (10, 10, 1, 1.0), (4, 1, 4, 1.0), (4, 1, 2, 0.5), (8, 3, 2, 1 - 10 / 28)],
)  # fmt: skip
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert eval_lib.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_formula_on_a_grid():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                ref = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert eval_lib.pass_at_k(n, c, k) == pytest.approx(ref, abs=1e-12)
    with pytest.raises(ValueError):
        eval_lib.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        eval_lib.pass_at_k(4, 1, 5)


@pytest.mark.parametrize(
    "answers,correct,k,expected",
    [
        (["A", "B", "A", "C"], [0, 1, 0, 0], 4, 0.0),  # majority A is wrong
        (["7", "7", "3", None], [1, 1, 0, 0], 4, 1.0),
        (["3", "7"], [0, 1], 2, 0.0),  # tie: the answer seen first wins
        (["7", "3"], [1, 0], 2, 1.0),
        ([None, None, "5"], [0, 0, 1], 3, 1.0),  # no-answer samples do not vote
        ([None, None], [0, 0], 2, 0.0),
        (["1", "1", "2", "2", "2", "1"], [1, 1, 0, 0, 0, 1], 3, 0.5),  # two blocks of 3
        (["1", "2", "2", "9", "9"], [1, 0, 0, 0, 0], 2, 0.5),  # blocks [1,2],[2,9]; 5th unused
        (["4", "4", "4"], [1, 1, 1], 1, 1.0),
    ],
)
def test_maj_at_k_hand_computed(answers, correct, k, expected):
    assert eval_lib.maj_at_k(answers, correct, k) == expected


def test_avg_at_n_hand_computed():
    assert eval_lib.avg_at_n([[1, 0, 1, 1], [0, 0, 0, 0]]) == 0.375
    assert eval_lib.avg_at_n([[1], [0], [1]]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        eval_lib.avg_at_n([1, 0])


def test_evaluate_on_a_fake_policy_with_known_accuracy():
    p, P, n = 0.6, 300, 9
    rng = np.random.default_rng(0)
    examples = [{"prompt": f"{i}+0=", "answer": str(i), "dataset": "arith"} for i in range(P)]

    def generate_fn(exs, num):
        # Correct with probability p; every wrong answer is distinct, so votes never pile on one.
        return [
            [ex["answer"] if rng.random() < p else f"wrong{j}" for j in range(num)] for ex in exs
        ]

    out = eval_lib.evaluate(generate_fn, examples, reward_fn="exact_match", n=n, ks=(1, 3, 9))
    assert out["num_problems"] == P and out["timeouts"] == out["errors"] == 0
    sd = math.sqrt(p * (1 - p) / (P * n))
    assert out[f"avg@{n}"] == pytest.approx(p, abs=4 * sd)
    assert out["pass@1"] == pytest.approx(out[f"avg@{n}"], abs=1e-12)
    assert out["pass@3"] == pytest.approx(1 - (1 - p) ** 3, abs=0.03)
    assert out["pass@9"] == pytest.approx(1 - (1 - p) ** 9, abs=0.01)
    # maj@3 with distinct wrong answers: >= 2 correct, or exactly 1 and it comes first (tie rule).
    maj3 = 3 * p**2 * (1 - p) + p**3 + p * (1 - p) ** 2
    assert out["maj@3"] == pytest.approx(maj3, abs=0.05)
    assert out["maj@1"] == pytest.approx(out["avg@9"], abs=1e-12)
    assert out["per_dataset"]["arith"]["avg@9"] == out["avg@9"]


def test_evaluate_math_per_dataset_with_timeouts_and_details():
    examples = [
        {"prompt": "2+2", "answer": "4", "dataset": "a", "id": "a0"},
        {"prompt": "half", "answer": "\\frac12", "dataset": "a", "id": "a1"},
        {"prompt": "hard", "answer": "7", "dataset": "b", "id": "b0"},
    ]
    outputs = {
        "a0": [r"\boxed{4}", r"\boxed{5}"],
        "a1": [r"\boxed{1/2}", r"so it is $\boxed{0.5}$"],
        "b0": ["no idea", HUGE_POWER],
    }
    seen = []

    def generate_fn(exs, num):
        seen.append((len(exs), num))
        return [outputs[ex["id"]] for ex in exs]

    out, details = eval_lib.evaluate(
        generate_fn, examples, reward_fn="math", n=2, ks=(1, 2, 4), timeout_s=10.0,
        return_details=True,
    )  # fmt: skip  # the tower is refused unevaluated (a timeout) at once: no deadline is waited
    assert seen == [(3, 2)]
    a, b = out["per_dataset"]["a"], out["per_dataset"]["b"]
    assert (a["avg@2"], a["pass@1"], a["pass@2"], a["maj@2"]) == (0.75, 0.75, 1.0, 1.0)
    assert (b["avg@2"], b["pass@2"], b["maj@2"]) == (0.0, 0.0, 0.0)
    assert out["avg@2"] == pytest.approx(0.5) and out["num_problems"] == 3
    assert "pass@4" not in out  # k > n is skipped
    assert out["timeouts"] == 1
    assert details[1]["answers"][0] == details[1]["answers"][1]  # 1/2 and 0.5 vote together
    assert details[0]["scores"] == [1.0, 0.0] and details[2]["completions"] == outputs["b0"]


def test_evaluate_with_a_callable_reward_counts_errors():
    examples = [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}]

    def reward(completion, gold):
        if completion == "boom":
            raise RuntimeError("bad reward")
        return float(completion == gold)

    out = eval_lib.evaluate(
        lambda exs, num: [["1", "boom"], ["2", "2"]], examples, reward_fn=reward, n=2, ks=(1, 2)
    )
    assert out["avg@2"] == 0.75 and out["errors"] == 1 and out["pass@2"] == 1.0
    assert set(out["per_dataset"]) == {"eval"}
    with pytest.raises(ValueError, match="completions"):
        eval_lib.evaluate(lambda exs, num: [["1"]], examples, reward_fn=reward, n=2)


def test_each_chunk_samples_with_its_own_key(monkeypatch):
    """The sampler draws row j from (key, j): with one key for every chunk, problem j of each
    chunk got the same draws, so problems were not sampled independently. Two chunks of
    identical prompts must differ, and the same seed must reproduce the same samples."""
    import jax

    from gvpo_jax import sampler, sharding

    def fake_sample_groups(model, prompts, *, settings, rng, mesh, rules):
        del model, mesh, rules  # row b's tokens are a function of (rng, b), as in the sampler
        rows = len(prompts) * settings.group_size
        tokens = jax.vmap(lambda b: jax.random.randint(jax.random.fold_in(rng, b), (4,), 1, 99))(
            np.arange(rows)
        )
        return SimpleNamespace(tokens_BxN=np.asarray(tokens), lengths_B=np.full(rows, 4))

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            return " ".join(map(str, ids))

    monkeypatch.setattr(sampler, "sample_groups", fake_sample_groups)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    examples = [{"prompt": "1+1=", "answer": "2", "prompt_ids": [5, 6]}] * 4
    settings = sampler.SamplingSettings(group_size=1, max_new_tokens=4, eos_ids=(0,), pad_id=0)

    def samples(seed):
        seen = []
        eval_lib.evaluate_policy(
            None, examples, tokenizer=Tokenizer(), settings=settings, mesh=mesh, rules=(),
            reward_fn=lambda completion, gold: seen.append(completion) or 0.0, n=3, chunk=2,
            seed=seed,
        )  # fmt: skip
        return seen[len(examples) :]  # the n-sample pass, after the greedy one

    first = samples(0)
    per_problem = [first[i * 3 : (i + 1) * 3] for i in range(4)]
    assert per_problem[0] != per_problem[2] and per_problem[1] != per_problem[3]  # chunk 0 vs 1
    assert first == samples(0) and first != samples(1)
