"""Multi-turn sampling with tools: decoding stops a row at a tool call, the host runs the call,
and the row resumes from its KV cache with the tool's answer prefilled.

The device side is two compiled programs over one carried `TurnState` (the prompts' keys and
values stored once, each row's own new-token columns, its tokens so far):

* `start`: prefill the P prompts once, draw every row's first token, decode.
* `resume`: prefill only each waiting row's new tokens (the observation: the tool's answer in
  the chat template's frame) into its own columns, draw its next token, decode.

Each program decodes in one `lax.while_loop` until no row is running: a row stops at an EOS,
at the tool-call stop sequence (`</tool_call>`, say: it then waits), or when its response (the
policy's tokens and the observations together) fills the N columns. Rows that are done stay
done; their slots compute and write nothing that is read again. The host (`sample_with_tools`)
reads the waiting rows' calls, runs them in parallel on a thread pool, turns each answer into
tokens (`tools.formats`), and resumes; up to `max_turns` tool calls per row.

Why turns and not a host callback inside the loop: a tool is untrusted Python that cannot run in
XLA, and a callback per call would stall every row's decode step for each call's latency.
Between turns nothing is left to decode (the loop runs until no row is running), so the calls
of a turn run together, one parallel batch per turn, and no row is ever re-prefilled: a row's
prompt and every token it has are read from the cache. docs/tools.md has the design.

Token t of row b is drawn with `token_keys(rng, b, t)` (t counts the observation tokens too),
so a row's sample does not depend on the other rows or on when its turns run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gvpo_jax import decode, models, sampler, sharding
from gvpo_jax.models.cache import per_layer
from gvpo_jax.sampling_ops import token_keys

RUNNING, WAITING, DONE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TurnSettings:
    """How a multi-turn rollout is sampled (static: one compiled `start` and one `resume` per
    settings and prompt bucket).

    sampling: the sampler's settings; `max_new_tokens` N bounds the whole response (the
      policy's tokens and the observations), `group_size`, EOS, temperature and truncations as
      in single-turn sampling (slots, shedding and routing records do not apply).
    stop_ids: the token sequence that ends a tool call (the policy's own tokens only).
    max_tool_tokens: U, an observation's tokens per turn at most (the resume's prefill width).
    chunk: decode steps per program call at most (0: until no row is running). With chunks,
      rows that are still running go on decoding while the host runs the calls of rows that
      stopped, and answers join at the next chunk's start; the samples are the same.
    """

    sampling: decode.SamplingSettings
    stop_ids: tuple[int, ...]
    max_tool_tokens: int
    chunk: int = 0

    def __post_init__(self):
        stop = tuple(int(i) for i in self.stop_ids)
        if not stop:
            raise ValueError("stop_ids is empty; give the token ids that end a tool call.")
        if int(self.max_tool_tokens) < 1:
            raise ValueError(f"max_tool_tokens must be >= 1, got {self.max_tool_tokens}.")
        sampling = dataclasses.replace(
            self.sampling,
            num_slots=0,
            shed=0,
            record_routes=False,
            eval_num_slots=0,
        )
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "stop_ids", stop)
        object.__setattr__(self, "max_tool_tokens", int(self.max_tool_tokens))
        if int(self.chunk) < 0:
            raise ValueError(f"chunk must be >= 0 (0: until no row runs), got {self.chunk}.")
        object.__setattr__(self, "chunk", int(self.chunk))


@flax.struct.dataclass
class TurnState:
    """What a multi-turn rollout carries between turns, on the device. B = P * G rows; row b
    continues prompt b // G; N response columns per row.

    cache: the prompts' keys and values once, and each row's own N + U new-token columns
      (`cache.SlotCache`, one slot per row); column t holds response token t once it is fed.
    lens_B: the row's prompt length (positions continue from it).
    pos_B: tokens in the row's response so far (policy and observation tokens); token
      pos - 1 is the next one fed.
    status_B: RUNNING, WAITING (stopped at a tool call) or DONE.
    tokens_BxN, logp_BxN, sample_logp_BxN: as `SampleOutput`'s (0 log-probs on observations).
    policy_BxN: 1.0 on the tokens the policy drew, 0.0 on observations and past the end.
    """

    cache: Any
    lens_B: jax.Array
    pos_B: jax.Array
    status_B: jax.Array
    tokens_BxN: jax.Array
    logp_BxN: jax.Array
    sample_logp_BxN: jax.Array
    policy_BxN: jax.Array
    rng: jax.Array


class ToolRollout(flax.struct.PyTreeNode):
    """A finished multi-turn rollout, as numpy (this process's rows). B rows, N columns.

    tokens_BxN: the response: the policy's tokens and the observations, in order; pad_id after.
    policy_BxN: 1.0 on the policy's tokens (what the losses count), 0.0 elsewhere.
    valid_BxN: 1.0 on every response token (what attention sees), 0.0 past the end.
    logp_BxN / sample_logp_BxN: the sampler's log-probs (T = 1 / as drawn) of the policy's
      tokens, 0 elsewhere. lengths_B: the response's tokens (valid_BxN's sum).
    calls_B, failed_B: tool calls each row wrote, and those that failed (an error answer, a
      timeout, a tool that raised; answered or not).
    turns_B: the row's turns (1 + calls answered); tool_tokens_B: its observation tokens.
    A call left unanswered (past max_turns, or no room left for its answer) ends its row.
    truncated_B: 1.0 where the row did not end at an EOS (cap, or a call left unanswered).
    tool_wait_s: seconds the device sat idle waiting for tools (no row running).
    """

    tokens_BxN: np.ndarray
    policy_BxN: np.ndarray
    valid_BxN: np.ndarray
    logp_BxN: np.ndarray
    sample_logp_BxN: np.ndarray
    lengths_B: np.ndarray
    calls_B: np.ndarray
    failed_B: np.ndarray
    turns_B: np.ndarray
    tool_tokens_B: np.ndarray
    truncated_B: np.ndarray
    tool_wait_s: float = flax.struct.field(pytree_node=False, default=0.0)


# ----------------------------------------------------------------------------------------------
# The device side


def _model(graphdef, state):
    """The model as decoding runs it: parameters cast to the compute dtype once, scanned layers
    sliced when the decode runs them unrolled (as `sampler.generate_split`)."""
    cfg = nnx.merge(graphdef, state).config
    model = nnx.merge(graphdef, models.cast_floating(state, cfg.compute_dtype))
    if cfg.scan_layers and not cfg.scan_decode:
        model = models.unstacked(model)
    return model


def _append(ts: TurnState, settings: TurnSettings, tokens_B, logp_B, slogp_B, active_B):
    """Write each active row's drawn token at its column `pos` and update its status: an EOS or
    a full response ends it, the stop sequence makes it wait for its tool call."""
    s = settings.sampling
    n, b = s.max_new_tokens, ts.pos_B.shape[0]
    rows_B = jnp.arange(b)
    at_B = jnp.where(active_B, ts.pos_B, n)  # n: dropped
    put = lambda buf, x: buf.at[rows_B, at_B].set(x.astype(buf.dtype), mode="drop")
    tokens_BxN = put(ts.tokens_BxN, tokens_B)
    policy_BxN = put(ts.policy_BxN, jnp.ones((b,), jnp.float32))
    pos_B = ts.pos_B + active_B.astype(jnp.int32)
    stop = jnp.asarray(settings.stop_ids, jnp.int32)
    m = stop.shape[0]
    start_B = jnp.maximum(pos_B - m, 0)
    window = lambda buf, i: jax.lax.dynamic_slice(buf, (i,), (m,))
    tail_BxM = jax.vmap(window)(tokens_BxN, start_B)
    drawn_BxM = jax.vmap(window)(policy_BxN, start_B) > 0
    called_B = (pos_B >= m) & jnp.all((tail_BxM == stop) & drawn_BxM, axis=1)
    eos_B, full_B = decode._is_eos(tokens_B, s.eos_ids), pos_B >= n
    # A call completed in the last column still waits: the host counts it and ends the row.
    status_B = jnp.where(
        active_B & eos_B,
        DONE,
        jnp.where(active_B & called_B, WAITING, jnp.where(active_B & full_B, DONE, ts.status_B)),
    )
    return ts.replace(
        pos_B=pos_B,
        status_B=status_B,
        tokens_BxN=tokens_BxN,
        policy_BxN=policy_BxN,
        logp_BxN=put(ts.logp_BxN, logp_B),
        sample_logp_BxN=put(ts.sample_logp_BxN, slogp_B),
    )


def _draw(ts: TurnState, settings: TurnSettings, logits_BxV, active_B) -> TurnState:
    rows_B = jnp.arange(ts.pos_B.shape[0], dtype=jnp.int32)
    keys_B = token_keys(ts.rng, rows_B, ts.pos_B)
    tokens_B, logp_B, slogp_B = settings.sampling.select(logits_BxV, keys_B)
    return _append(ts, settings, tokens_B, logp_B, slogp_B, active_B)


def _decode(model, ts: TurnState, settings: TurnSettings) -> TurnState:
    """Decode until no row is running (or for `settings.chunk` steps): every step feeds each
    row's last token at its column and draws its next (rows not running compute, and their
    draws are dropped)."""

    def step(ts: TurnState) -> TurnState:
        column_B = ts.pos_B - 1
        fed_B = jnp.take_along_axis(ts.tokens_BxN, column_B[:, None], axis=1)
        logits_Bx1xV, cache = model(
            fed_B,
            (ts.lens_B + column_B)[:, None],
            jnp.ones(fed_B.shape, jnp.bool_),
            cache=ts.cache,
            cache_index=column_B,
        )
        running_B = ts.status_B == RUNNING
        return _draw(ts.replace(cache=cache), settings, logits_Bx1xV[:, 0], running_B)

    if not settings.chunk:
        return jax.lax.while_loop(lambda ts: jnp.any(ts.status_B == RUNNING), step, ts)
    go = lambda carry: jnp.any(carry[0].status_B == RUNNING) & (carry[1] < settings.chunk)
    return jax.lax.while_loop(go, lambda carry: (step(carry[0]), carry[1] + 1), (ts, 0))[0]


def _rules(mesh, rules):
    """Inside a traced program: the mesh's logical-axis rules, when it runs on one."""
    return contextlib.nullcontext() if mesh is None else sharding.tracing_mesh(mesh, rules)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "queues", "mesh", "rules"))
def start(
    graphdef,
    state,
    prompt_ids,
    prompt_lens,
    rng,
    *,
    settings: TurnSettings,
    queues: int = 1,
    mesh=None,
    rules=None,
):
    """The first turn: prefill the P prompts [P, T] once (right-padded, `sampler.pad_prompts`),
    draw token 0 of each of the P * G rows from its prompt's logits, and decode until no row is
    running. `queues` = D: rows, prompts and slots in D contiguous parts (the mesh's row
    shards), each slot reading its own part's prompts only; `mesh` / `rules`: the logical-axis
    rules to trace under. Returns the `TurnState`."""
    with _rules(mesh, rules):
        return _start(graphdef, state, prompt_ids, prompt_lens, rng, settings, queues)


def _start(graphdef, state, prompt_ids, prompt_lens, rng, settings: TurnSettings, queues: int):
    p, t = prompt_ids.shape
    s = settings.sampling
    g, n, u = s.group_size, s.max_new_tokens, settings.max_tool_tokens
    b = p * g
    if p % queues:
        raise ValueError(f"{p} prompts do not split into {queues} equal parts.")
    model = _model(graphdef, state)
    lens_P = prompt_lens.astype(jnp.int32)
    positions_PxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    hidden_PxTxD, prefix = model.hidden(
        prompt_ids.astype(jnp.int32),
        positions_PxT,
        positions_PxT < lens_P[:, None],
        cache=model.init_cache(p, t),
        cache_index=0,
    )
    last_PxD = jnp.take_along_axis(hidden_PxTxD, (lens_P - 1)[:, None, None], axis=1)[:, 0]
    logits_BxV = jnp.repeat(model.unembed(last_PxD), g, axis=0)
    # One slot per row; slot i of part d continues prompt d * P / D + i // G.
    index_DxS = jnp.broadcast_to(
        jnp.arange(b // queues, dtype=jnp.int32) // g, (queues, b // queues)
    )
    cache = model.slot_cache(prefix, b, n + u, queues=queues)
    cache = per_layer(lambda c: c.replace(prefix_index=index_DxS), cache)
    ts = TurnState(
        cache=cache,
        lens_B=jnp.repeat(lens_P, g),
        pos_B=jnp.zeros((b,), jnp.int32),
        status_B=jnp.full((b,), RUNNING, jnp.int32),
        tokens_BxN=jnp.full((b, n), s.pad_id, jnp.int32),
        logp_BxN=jnp.zeros((b, n), jnp.float32),
        sample_logp_BxN=jnp.zeros((b, n), jnp.float32),
        policy_BxN=jnp.zeros((b, n), jnp.float32),
        rng=rng,
    )
    ts = _draw(ts, settings, logits_BxV, jnp.ones((b,), jnp.bool_))
    return _decode(model, ts, settings)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "settings", "mesh", "rules"), donate_argnums=(2,)
)
def resume(
    graphdef,
    state,
    ts: TurnState,
    forced_BxU,
    forced_len_B,
    finish_B,
    *,
    settings: TurnSettings,
    mesh=None,
    rules=None,
):
    """The next turn: each waiting row with forced_len_B[b] > 0 gets its observation
    forced_BxU[b, :forced_len_B[b]] written after its tokens (mask 0), prefilled into its own
    columns in one forward with its last token, and draws its next token from there; rows
    still running (a chunk ended) feed their last token in the same forward and draw on; rows
    with finish_B[b] are done (a call left unanswered: max turns, no room); other waiting rows
    keep waiting (their answer is not back yet). Then decode. The caller keeps pos_B +
    forced_len_B < N (room for the policy's next token)."""
    with _rules(mesh, rules):
        return _resume(graphdef, state, ts, forced_BxU, forced_len_B, finish_B, settings)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "settings", "mesh", "rules"), donate_argnums=(2,)
)
def advance(graphdef, state, ts: TurnState, *, settings: TurnSettings, mesh=None, rules=None):
    """The next chunk of decode steps when nothing is answered or ended (no prefill)."""
    with _rules(mesh, rules):
        return _decode(_model(graphdef, state), ts, settings)


def _resume(
    graphdef, state, ts: TurnState, forced_BxU, forced_len_B, finish_B, settings: TurnSettings
):
    s = settings.sampling
    n, u = s.max_new_tokens, settings.max_tool_tokens
    b = ts.pos_B.shape[0]
    model = _model(graphdef, state)
    forced_len_B = jnp.asarray(forced_len_B, jnp.int32)
    go_B = (ts.status_B == WAITING) & (forced_len_B > 0)
    forced_len_B = jnp.where(go_B, forced_len_B, 0)
    draw_B = go_B | (ts.status_B == RUNNING)
    # Feed [last token, observation...] at columns pos - 1 ... pos - 1 + U; padding past a
    # row's observation writes columns beyond its end, masked until rewritten.
    last_Bx1 = jnp.take_along_axis(ts.tokens_BxN, (ts.pos_B - 1)[:, None], axis=1)
    fed_BxU1 = jnp.concatenate([last_Bx1, jnp.asarray(forced_BxU, jnp.int32)], axis=1)
    column_B = ts.pos_B - 1
    positions_BxU1 = ts.lens_B[:, None] + column_B[:, None] + jnp.arange(u + 1, dtype=jnp.int32)
    hidden_BxU1xD, cache = model.hidden(
        fed_BxU1,
        positions_BxU1,
        jnp.ones(fed_BxU1.shape, jnp.bool_),
        cache=ts.cache,
        cache_index=column_B,
    )
    last_BxD = jnp.take_along_axis(hidden_BxU1xD, forced_len_B[:, None, None], axis=1)[:, 0]
    rows_B = jnp.arange(b)
    at_BxU = ts.pos_B[:, None] + jnp.arange(u)
    at_BxU = jnp.where(jnp.arange(u) < forced_len_B[:, None], at_BxU, n)  # n: dropped
    tokens_BxN = ts.tokens_BxN.at[rows_B[:, None], at_BxU].set(
        jnp.asarray(forced_BxU, jnp.int32), mode="drop"
    )
    ts = ts.replace(
        cache=cache,
        tokens_BxN=tokens_BxN,
        pos_B=ts.pos_B + forced_len_B,
        status_B=jnp.where(
            go_B, RUNNING, jnp.where((ts.status_B == WAITING) & finish_B, DONE, ts.status_B)
        ),
    )
    ts = _draw(ts, settings, model.unembed(last_BxD), draw_B)
    return _decode(model, ts, settings)


# ----------------------------------------------------------------------------------------------
# The host side


@dataclasses.dataclass(frozen=True)
class Tools:
    """A run's tools: how its rollouts are sampled (`settings`), how calls and answers read as
    tokens (`format`: a `tools.formats` format, which holds the registry), the answered calls
    per response at most, and how long a turn waits for its calls."""

    settings: TurnSettings
    format: Any
    max_turns: int
    timeout_s: float = 30.0

    def sample(self, model, prompts, *, tokenizer, rng, mesh=None, rules=None) -> ToolRollout:
        """`sample_with_tools` with this run's settings (rows over `mesh`, when given)."""
        kw = {} if mesh is None else {"mesh": mesh, "rules": rules}
        return sample_with_tools(
            model,
            prompts,
            settings=self.settings,
            answer=self.format.answer,
            decode_text=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            rng=rng,
            max_turns=self.max_turns,
            timeout_s=self.timeout_s,
            late=lambda room, why: self.format.error(why, room),
            **kw,
        )


def final_turns(out: ToolRollout) -> np.ndarray:
    """[B] where each row's last turn begins: one past its last observation token (0 for a
    row that called nothing). What a task scores: the policy's final answer."""
    n = out.policy_BxN.shape[1]
    obs = (out.valid_BxN > 0) & (out.policy_BxN == 0)
    return np.where(obs.any(1), n - np.argmax(obs[:, ::-1], axis=1), 0)


@dataclasses.dataclass
class _Row:
    """What the host tracks of one row between turns."""

    turn_begin: int = 0  # where the policy's current turn began
    calls: int = 0  # tool calls the policy wrote
    answered: int = 0  # calls whose observation it read
    failed: int = 0  # calls that failed (an error answer, a timeout, a crash)
    tool_tokens: int = 0


# The host loop's pool (a tool that waits on I/O or a subprocess holds a thread, not the
# interpreter: room for a batch's calls at once) and its gather window: with no row running,
# once the first answer is back the device also waits for the others while they keep coming
# (each within GATHER_S of the last), so answers that come back together resume in one
# program, not one program per straggler.
POOL_THREADS = 256
GATHER_S = 0.005


class _Call:
    """One tool call on the pool. Its time limit counts from when a worker starts it (a call
    queued behind others is not late); a call never started within 4 x the limit of its
    submission (the pool jammed by tools that ignore their own limits) is late too."""

    def __init__(self, pool, answer, text: str, room: int, timeout_s: float):
        self.timeout_s, self.submitted, self.started = timeout_s, time.monotonic(), None

        def run():
            self.started = time.monotonic()
            return answer(text, room)

        self.future = pool.submit(run)

    def deadline(self) -> float:
        if self.started is None:
            return self.submitted + 4 * self.timeout_s
        return self.started + self.timeout_s

    def outcome(self):
        """None while it runs; ((ids, ok), "") when answered; (None, why) when it failed."""
        if self.future.done():
            error = self.future.exception()
            if error is None:
                return self.future.result()
            return None, f"the tool call failed ({type(error).__name__})"
        if time.monotonic() >= self.deadline():
            return None, f"the tool did not answer within {self.timeout_s:g} s"
        return None


def sample_with_tools(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    settings: TurnSettings,
    answer: Callable[[str, int], tuple[list[int], bool]],
    decode_text: Callable[[list[int]], str],
    rng: jax.Array,
    max_turns: int,
    mesh=None,
    rules=sharding.LOGICAL_RULES,
    pool: concurrent.futures.Executor | None = None,
    timeout_s: float = 30.0,
    late: Callable[[int, str], list[int]] | None = None,
) -> ToolRollout:
    """G responses for each prompt (rows grouped contiguously), calling tools between turns.

    answer(turn_text, room) -> (observation ids, ok): the observation for a row that stopped
      at a tool call, given the text the policy wrote in this turn (its call at the end) and
      the tokens it may take (at most U, leaving one column for the policy's next token);
      [] when not even a truncated answer fits (the row ends there). Called on `pool`'s
      threads (default: POOL_THREADS) as soon as a program call returns the row waiting;
      with `settings.chunk` the other rows decode meanwhile, and the answer joins at the first
      chunk boundary after it is back. The device waits for tools only when no row runs, and
      then for the answers that come back together (`GATHER_S`).
    decode_text(ids) -> str: the tokenizer's decode of a turn's ids.
    max_turns: tool calls answered per row at most; a row calling past it ends there.
    mesh: rows split over its data x fsdp shards (P a multiple of them); None: one device.
    timeout_s: how long a call's answer is waited for once it runs; a call still running
      then, or whose `answer` raised, is failed and reads late(room, why) (default: [], the
      row ends), why naming the failure. A Python
      thread cannot be killed: a tool must bound its own time (the built-in ones do); past
      the timeout the rollout stops waiting for it, it goes on.
    """
    s = settings.sampling
    n, u, g = s.max_new_tokens, settings.max_tool_tokens, s.group_size
    ids, lens = sampler.pad_prompts(prompts, s.buckets, s.pad_id)
    graphdef, state = nnx.split(model)
    queues = 1
    if mesh is not None:
        queues = sharding.batch_shards(mesh)
        sharding.check_split(len(prompts), mesh, "prompts", "sample a multiple of that many")
        put = sharding.shard_batch({"ids": ids, "lens": lens}, mesh)
        ids, lens = put["ids"], put["lens"]
    where = {} if mesh is None else {"mesh": mesh, "rules": rules}
    ts = start(graphdef, state, ids, lens, rng, settings=settings, queues=queues, **where)
    rows = [_Row() for _ in range(len(prompts) * g)]
    own = pool or concurrent.futures.ThreadPoolExecutor(max_workers=POOL_THREADS)
    pending: dict[int, _Call] = {}  # row: its call, on the pool
    waited = 0.0  # seconds the device sat idle on the tools (no row running)

    def room_of(b, pos):
        return min(u, n - int(pos[b]) - 1)

    try:
        while True:
            status, pos = _local(ts.status_B, mesh), _local(ts.pos_B, mesh)
            finish = np.zeros(len(rows), bool)
            new = [b for b in np.flatnonzero(status == WAITING) if b not in pending]
            if new:
                tokens = _local(ts.tokens_BxN, mesh)
            for b in new:  # a call the policy just wrote: answer it, or end the row there
                rows[b].calls += 1
                room = room_of(b, pos)
                if rows[b].answered >= max_turns or room <= 0:
                    finish[b] = True
                    continue
                text = decode_text(tokens[b, rows[b].turn_begin : pos[b]].tolist())
                pending[b] = _Call(own, answer, text, room, timeout_s)
            running = bool(np.any(status == RUNNING))
            if not running and not pending and not finish.any():
                break
            if not running and pending and not finish.any():  # nothing to decode: wait
                t0 = time.monotonic()
                _, rest = concurrent.futures.wait(
                    [c.future for c in pending.values()],
                    timeout=max(min(c.deadline() for c in pending.values()) - t0, 0.01),
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
                while rest:  # answers coming back together join one resume
                    more, rest = concurrent.futures.wait(
                        rest, timeout=GATHER_S, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    if not more:
                        break
                waited += time.monotonic() - t0
            forced = np.full((len(rows), u), s.pad_id, np.int32)
            forced_len = np.zeros((len(rows),), np.int32)
            for b, call in list(pending.items()):
                got = call.outcome()
                if got is None:
                    continue  # still running: the row keeps waiting
                del pending[b]
                if got[0] is None:  # failed: the late observation says why
                    got = (late(room_of(b, pos), got[1]) if late else []), False
                obs, ok = got
                rows[b].failed += int(not ok)
                obs = list(obs)[: max(room_of(b, pos), 0)]
                if not obs:  # not even the error fits: the row ends at its call
                    finish[b] = True
                    continue
                rows[b].answered += 1
                rows[b].tool_tokens += len(obs)
                rows[b].turn_begin = int(pos[b]) + len(obs)
                forced[b, : len(obs)], forced_len[b] = obs, len(obs)
            if not forced_len.any() and not finish.any():
                if not running:
                    continue  # answers still out: wait again
                ts = advance(graphdef, state, ts, settings=settings, **where)
                continue
            if mesh is not None:
                put = sharding.shard_batch({"f": forced, "n": forced_len, "e": finish}, mesh)
                forced, forced_len, finish = put["f"], put["n"], put["e"]
            ts = resume(graphdef, state, ts, forced, forced_len, finish, settings=settings, **where)
    finally:
        if pool is None:
            own.shutdown(wait=False)
    pos = _local(ts.pos_B, mesh)
    tokens = _local(ts.tokens_BxN, mesh)
    valid = (np.arange(n)[None, :] < pos[:, None]).astype(np.float32)
    ended = np.zeros(len(pos), bool)
    for eos in s.eos_ids:
        ended |= ((tokens == eos) & (_local(ts.policy_BxN, mesh) > 0)).any(-1)
    return ToolRollout(
        tokens_BxN=np.where(valid > 0, tokens, s.pad_id).astype(np.int32),
        policy_BxN=_local(ts.policy_BxN, mesh),
        valid_BxN=valid,
        logp_BxN=_local(ts.logp_BxN, mesh),
        sample_logp_BxN=_local(ts.sample_logp_BxN, mesh),
        lengths_B=pos.astype(np.int32),
        calls_B=np.array([r.calls for r in rows], np.int32),
        failed_B=np.array([r.failed for r in rows], np.int32),
        turns_B=np.array([1 + r.answered for r in rows], np.int32),
        tool_tokens_B=np.array([r.tool_tokens for r in rows], np.int32),
        truncated_B=(~ended).astype(np.float32),
        tool_wait_s=waited,
    )


def _local(x, mesh) -> np.ndarray:
    return np.asarray(x) if mesh is None else sharding.local_rows(x)
