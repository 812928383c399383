"""A run's task: the training stream (grain, exact resume), the held-out set, and the reward.

The task never changes during a run; where the run is in its stream is a `DataCursor`, part of
the loop state (`rl_step.LoopState`): `examples, cursor = task.next_train(n, cursor)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gvpo_jax import data, rewards
from gvpo_jax.data.pipeline import make_stream
from gvpo_jax.errors import BadInputError

# Reward of each task when config.data.rewards is empty.
DEFAULT_REWARDS = {
    "arith": "exact_match:1",
    "gsm8k": "math:1",
    "math": "math:1",
    "math_gsm8k": "math:1",
    "jsonl": "math:1",
}
# Held-out split of each task (arith: its own fixed set).
EVAL_SPLIT = {
    "gsm8k": ("gsm8k", "test"),
    "math": ("math500", "test"),
    "math_gsm8k": ("math500", "test"),
    "jsonl": ("jsonl", "test"),
}


class DataError(BadInputError):
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
    """ "math:1,format:0.1" -> [("math", 1.0), ("format", 0.1)] (`rewards.parse_specs`)."""
    return rewards.parse_specs(text)


@dataclasses.dataclass(frozen=True)
class DataCursor:
    """Where a run is in its training stream; identical on every process, checkpointed."""

    position: int = 0  # global stream position of the next unread example
    dropped: int = 0  # examples skipped for not fitting max_prompt_len (held-out ones included)

    def state_dict(self) -> dict:
        return {"position": self.position, "dropped": self.dropped}

    @classmethod
    def from_state_dict(cls, state: dict) -> DataCursor:
        return cls(position=int(state["position"]), dropped=int(state["dropped"]))


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
            max_operand=c.arith.max_operand,
            ops=c.arith.ops,
            seed=config.seed,
            eval_size=c.eval_size,
            style=c.arith.style,
        )
    try:
        if c.task == "math_gsm8k":
            return _Concat(
                [
                    data.load_task("math", split, path=c.path),
                    data.load_task("gsm8k", split, path=c.path),
                ]
            )
        return data.load_task(
            c.task,
            split,
            path=c.path,
            prompt_field=c.prompt_field,
            answer_field=c.answer_field,
            arith=arith,
        )
    except (OSError, ValueError, KeyError) as e:
        reason = str(e).strip().rstrip(".")  # name the file when the loader's reason does not
        where = f" from config.data.path {c.path!r}" if c.path and c.path not in reason else ""
        raise DataError(
            f"data.task={c.task!r} split {split!r} could not be loaded{where}: {reason}."
        ) from e


class Task:
    """Training examples with their prompt ids, held-out examples, and batch scoring."""

    def __init__(
        self,
        tokenizer,
        train_source: Sequence[dict] | None,
        held_out: Sequence[dict],
        *,
        name: str,
        seed: int,
        template: str,
        max_prompt_len: int,
        use_chat_template: bool,
        on_too_long: str,
        reward_specs: Sequence[tuple[str, float]],
        reward_timeout_s: float,
        reward_workers: int,
        shard_index: int = 0,
        shard_count: int = 1,
        allgather=None,
        tools: Sequence[dict] | None = None,
    ):
        """train_source: random-access training examples (shuffled by a seeded stream), or None
        for an evaluation-only task (no stream, no held-out set); held_out: the evaluation
        examples; name: the task's name in error messages.
        reward_specs: [(reward name, weight)] of `gvpo_jax.rewards`, scored with
        `reward_timeout_s` per sample in `reward_workers` processes (`rewards.score_batch`).
        shard_index / shard_count: this process's data shard (`sharding.data_shard`), used to
        split the prompt-length checks of a batch; allgather: `sharding.host_allgather` (a
        collective over the processes; only called when shard_count > 1); tools: the JSON
        schemas the chat template shows in every prompt (a run with tools, chat format)."""
        self.shard_index, self.shard_count = shard_index, shard_count
        self._allgather = allgather
        self.tokenizer = tokenizer
        self.encode_kw = dict(
            template=template,
            max_prompt_len=max_prompt_len,
            use_chat_template=use_chat_template,
            on_too_long=on_too_long,
            tools=list(tools) if tools else None,
        )
        self.reward_specs = list(reward_specs)
        self.timeout_s = reward_timeout_s
        self.num_workers = reward_workers
        if train_source is None:  # evaluation only (mode=eval over eval.sets): no stream
            self._stream, self.eval_examples, self.start = None, [], DataCursor()
            return
        if len(train_source) == 0:
            raise DataError(f"the training set of data.task={name!r} is empty; check data.path.")
        self._stream = make_stream(train_source, seed=seed)
        kept, self.eval_examples = self._encode_kept(list(held_out))
        if not self.eval_examples:
            raise DataError(f"no held-out example of {name!r} fits data.max_prompt_len.")
        # A run starts at the stream's beginning, with the held-out drops already counted.
        self.start = DataCursor(position=0, dropped=len(held_out) - len(kept))

    def encode(self, examples: Sequence[dict]) -> tuple[list[dict], int]:
        """(the examples that fit data.max_prompt_len, with their `prompt_ids`; how many did not):
        the run's template, chat template and length rule, as for the held-out set."""
        kept, encoded = self._encode_kept(list(examples))
        return encoded, len(examples) - len(kept)

    def _encode_kept(self, examples: Sequence[dict]) -> tuple[list[int], list[dict]]:
        try:
            ids, _, kept, _ = data.encode_prompts(self.tokenizer, examples, **self.encode_kw)
        except ValueError as e:  # on_too_long="error": a prompt longer than max_prompt_len
            raise DataError(str(e).rstrip(".") + ".") from e
        kept = [int(i) for i in kept]
        return kept, [dict(examples[i], prompt_ids=p) for i, p in zip(kept, ids, strict=True)]

    def next_train(
        self, n: int, cursor: DataCursor, rows: Sequence[int] | None = None
    ) -> tuple[list[dict], DataCursor]:
        """Rows `rows` (default: all) of the global batch of the n training examples after
        `cursor`, and the cursor after them.

        The global batch is the next n examples of the stream that fit max_prompt_len (longer
        ones dropped and counted), whatever the number of processes; a process loads only the
        examples of its rows (plus its share of the length checks when the batch needs them
        split: with several data shards every process checks a slice of the candidates and the
        fit masks are all-gathered, so all processes agree on the batch and the position).
        """
        position, dropped = cursor.position, cursor.dropped
        if self.shard_count == 1:
            out: list[dict] = []
            while len(out) < n:
                start, position = position, position + n - len(out)
                examples = [self._stream[k] for k in range(start, position)]
                kept, encoded = self._encode_kept(examples)
                dropped += len(examples) - len(kept)
                out += encoded
            out = out if rows is None else [out[int(r)] for r in rows]
            return out, DataCursor(position, dropped)
        kept: list[int] = []
        cache: dict[int, dict] = {}
        while len(kept) < n:
            m = n - len(kept)
            start, position = position, position + m
            per = -(-m // self.shard_count)  # contiguous blocks of the candidates per shard
            lo = start + min(self.shard_index * per, m)
            hi = start + min((self.shard_index + 1) * per, m)
            fits = np.zeros(per + 1, np.int64)
            fits[0] = self.shard_index
            for k, ex in zip(range(lo, hi), self._encode_each(range(lo, hi)), strict=True):
                fits[1 + k - lo] = ex is not None
                if ex is not None:
                    cache[k] = ex
            by_shard = {int(f[0]): f[1:] for f in self._allgather(fits)}
            mask = np.concatenate([by_shard[i] for i in range(self.shard_count)])[:m]
            kept += [start + int(j) for j in np.flatnonzero(mask)]
            dropped += int(m - mask.sum())
        wanted = range(n) if rows is None else rows
        missing = [kept[int(r)] for r in wanted if kept[int(r)] not in cache]
        cache.update(zip(missing, self._encode_each(missing), strict=True))
        return [cache[kept[int(r)]] for r in wanted], DataCursor(position, dropped)

    def _encode_each(self, positions) -> list[dict | None]:
        """Stream examples at `positions`, encoded; None where a prompt does not fit (the caller
        counts drops: every process checks only its slice)."""
        examples = [self._stream[k] for k in positions]
        out: list[dict | None] = [None] * len(examples)
        if examples:
            for i, ex in zip(*self._encode_kept(examples), strict=True):
                out[i] = ex
        return out

    def score(self, completions: list[str], golds: list[str]):
        scores, info = rewards.score_batch(
            completions,
            golds,
            reward_specs=self.reward_specs,
            timeout_s=self.timeout_s,
            num_workers=self.num_workers,
        )
        return scores, {k: info[k] for k in ("timeouts", "errors", "refused")}

    @property
    def eval_reward(self):
        """What evaluation scores with: the reward's name (batch-scored) or a weighted callable."""
        if len(self.reward_specs) == 1 and self.reward_specs[0][1] == 1.0:
            return self.reward_specs[0][0]
        return lambda completion, gold: float(self.score([completion], [gold])[0][0])

    def close(self) -> None:
        rewards.close_pools()


def build_task(config, tokenizer, *, shard=(0, 1), allgather=None, tools=None) -> Task:
    """The run's Task from its config; `shard` = (index, count) of this process's data shard;
    `tools`: the JSON schemas its chat template shows (a run with tools in the chat format).

    mode=eval over eval.sets reads no training data and no held-out set: the sets are loaded
    and encoded (`Task.encode`) by the evaluation."""
    c = config.data
    eval_only = config.mode == "eval" and bool(config.eval.sets)
    train_source = None if eval_only else _load(config, "train")  # first: its errors reported
    if eval_only:
        held_out = []
    elif c.task == "arith":
        held_out = _load(config, "eval")
    else:
        task, split = EVAL_SPLIT[c.task]
        held_out = list(data.load_task(task, split, path=c.path))[: c.eval_size]
    return Task(
        tokenizer,
        train_source,
        held_out,
        name=c.task,
        seed=config.seed,
        template=c.template,
        max_prompt_len=c.max_prompt_len,
        use_chat_template=c.use_chat_template,
        on_too_long=c.on_too_long,
        reward_specs=parse_reward_specs(c.get("rewards", "") or DEFAULT_REWARDS[c.task]),
        reward_timeout_s=config.train.reward_timeout_s,
        reward_workers=config.train.reward_workers,
        shard_index=shard[0],
        shard_count=shard[1],
        allgather=allgather,
        tools=tools,
    )
