"""A run's task: the training stream (grain, exact resume), the held-out set, and the reward."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gvpo_jax import data, rewards

# Reward of each task when config.data.rewards is empty.
DEFAULT_REWARDS = {"arith": "exact_match:1", "gsm8k": "math:1", "math": "math:1",
                   "math_gsm8k": "math:1", "jsonl": "math:1"}  # fmt: skip
# Held-out split of each task (arith: its own fixed set).
EVAL_SPLIT = {"gsm8k": ("gsm8k", "test"), "math": ("math500", "test"),
              "math_gsm8k": ("math500", "test"), "jsonl": ("jsonl", "test")}  # fmt: skip


class DataError(ValueError):
    """Unusable data (empty dataset, unparsable file, nothing fits max_prompt_len)."""


def eos_ids(tokenizer) -> tuple[int, ...]:
    """EOS ids the sampler stops on: the tokenizer's eos plus chat end-of-turn tokens it knows."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None and tid not in ids:
            ids.append(int(tid))
    if not ids:
        raise DataError("the tokenizer has no EOS token; use a tokenizer with eos_token set.")
    return tuple(int(i) for i in ids)


def parse_reward_specs(text: str) -> list[tuple[str, float]]:
    """ "math:1,format:0.1" -> [("math", 1.0), ("format", 0.1)]."""
    specs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        specs.append((name, float(weight or 1.0)))
    return specs


class _Concat:
    """Random access over several sources, one after the other."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> dict:
        j = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return self.parts[j][i - int(self.offsets[j])]


def _load(config, split: str):
    c = config.data
    arith = None
    if c.task == "arith":
        arith = data.ArithTask(
            max_operand=c.arith.max_operand, ops=c.arith.ops, seed=config.seed,
            eval_size=c.eval_size, style=c.arith.style,
        )  # fmt: skip
    try:
        if c.task == "math_gsm8k":
            return _Concat([data.load_task("math", split, path=c.path),
                            data.load_task("gsm8k", split, path=c.path)])  # fmt: skip
        return data.load_task(c.task, split, path=c.path, prompt_field=c.prompt_field,
                              answer_field=c.answer_field, arith=arith)  # fmt: skip
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"data.task={c.task!r} split {split!r} could not be loaded: {e}.") from e


class Task:
    """Training examples with their prompt ids, held-out examples, and batch scoring."""

    def __init__(self, config, tokenizer):
        c = config.data
        self.tokenizer = tokenizer
        self.encode_kw = dict(
            template=c.template,
            max_prompt_len=c.max_prompt_len,
            use_chat_template=c.use_chat_template,
            on_too_long=c.on_too_long,
        )
        self.reward_specs = parse_reward_specs(c.get("rewards", "") or DEFAULT_REWARDS[c.task])
        self.timeout_s = config.train.reward_timeout_s
        self.num_workers = config.train.reward_workers
        source = _load(config, "train")
        if len(source) == 0:
            raise DataError(f"the training set of data.task={c.task!r} is empty; check data.path.")
        self._iter = data.make_iterator(source, seed=config.seed, batch_size=1)
        self.dropped = 0
        if c.task == "arith":
            held_out = list(_load(config, "eval"))
        else:
            task, split = EVAL_SPLIT[c.task]
            held_out = list(data.load_task(task, split, path=c.path))[: c.eval_size]
        self.eval_examples = self._encode(held_out)
        if not self.eval_examples:
            raise DataError(f"no held-out example of {c.task!r} fits data.max_prompt_len.")

    def _encode(self, examples: Sequence[dict]) -> list[dict]:
        try:
            ids, _, kept, dropped = data.encode_prompts(self.tokenizer, examples, **self.encode_kw)
        except ValueError as e:  # on_too_long="error": a prompt longer than max_prompt_len
            raise DataError(str(e).rstrip(".") + ".") from e
        self.dropped += dropped
        return [dict(examples[int(i)], prompt_ids=p) for i, p in zip(kept, ids, strict=True)]

    def next_train(self, n: int) -> list[dict]:
        """The next n training examples that fit max_prompt_len (longer ones dropped, counted)."""
        out: list[dict] = []
        while len(out) < n:
            out += self._encode([next(self._iter)[0] for _ in range(n - len(out))])
        return out

    def score(self, completions: list[str], golds: list[str]):
        scores, info = rewards.score_batch(
            completions,
            golds,
            reward_specs=self.reward_specs,
            timeout_s=self.timeout_s,
            num_workers=self.num_workers,
        )
        return scores, {"timeouts": info["timeouts"], "errors": info["errors"]}

    @property
    def eval_reward(self):
        """What evaluation scores with: the reward's name (batch-scored) or a weighted callable."""
        if len(self.reward_specs) == 1 and self.reward_specs[0][1] == 1.0:
            return self.reward_specs[0][0]
        return lambda completion, gold: float(self.score([completion], [gold])[0][0])

    def get_state(self) -> dict:
        return {"iterator": self._iter.get_state(), "dropped": self.dropped}

    def set_state(self, state: dict) -> None:
        self._iter.set_state(state["iterator"])
        self.dropped = state["dropped"]

    def close(self) -> None:
        rewards.close_pools()


def build_task(config, tokenizer, workdir: str) -> Task:
    del workdir
    return Task(config, tokenizer)
