"""Routing replay on MoE policies (`algo.routing_replay`): R3 replays the sampler's routing
record, R2 the old-policy pass's; replay replaces the selection only (the router keeps its
gradient) and never reaches the reference pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax.models import moe
from gvpo_jax.rl_step import rl_step
from tests.helpers import MOE_OVERRIDES
from tests.test_train import make_run, toy_config


def _near_tied(state, eps: float = 1e-6):
    """Every router's logits tied up to `eps` (columns equal but for eps-sized noise), so float
    noise decides the top k: the sampler's cached decode and a full forward over the same
    tokens pick different experts for some of them. The experts scaled up 3x, so a token's
    experts move its log-probs."""

    def tie(path, x):
        name = jax.tree_util.keystr(path)
        if "router_kernel" in name:
            return 1.0 + eps * jax.random.normal(jax.random.key(0), x.shape, x.dtype)
        if any(k in name for k in ("gate_kernel", "up_kernel", "down_kernel")):
            return 3.0 * x
        return x

    return state.replace(params=jax.tree_util.tree_map_with_path(tie, state.params))


def _moe_run(algo: str, *, eps: float = 1e-6, layers: int = 1, **changes):
    """An MoE policy (two layers: two routings to keep apart), its routers tied up to `eps`."""
    changes = dict(MOE_OVERRIDES, **{"model.overrides.num_layers": layers}, **changes)
    run, state, loop, ref = make_run(toy_config(algo, **changes))
    return run, _near_tied(state, eps), loop, ref


def _spy(run, calls: list):
    """Records every call of `run.updater.logprobs` (its arguments and result) in `calls`; a
    call that replays a routing is also run without it (its result third)."""
    real = run.updater.logprobs

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        plain = real(*args) if kwargs.get("routing") is not None else None
        calls.append((args, kwargs, out, plain))
        return out

    run.updater.logprobs = spy


@pytest.mark.parametrize(
    "extra",
    [{"algo.num_minibatches": 2}, {"optim.pack_groups": True, "optim.length_buckets": 2}],
    ids=["old-policy-pass", "packed-single-update"],
)
def test_r3_gives_the_samplers_log_probs_where_the_routing_drifts(extra):
    """fp32 sampling and updates over near-tied routers: the update's full forward routes some
    tokens elsewhere than the sampler's decode did (moe/routing_drift), so without replay its
    log-probs at the start of the step differ from the sampler's; R3 replays the sampler's
    record and gives them back exactly (from the old-policy pass, and from a packed single
    update's own forward). The reference pass (a KL penalty's) runs unreplayed."""
    changes = {"algo.routing_replay": "r3", "algo.kl_coef": 0.01, **extra}
    # two MoE layers where the old-policy pass replays: a record of the wrong layer would show
    layers = 1 if extra.get("optim.pack_groups") else 2
    run, state, loop, ref = _moe_run("grpo", layers=layers, **changes)
    calls = []
    _spy(run, calls)
    state, metrics, _, _ = rl_step(run, state, loop, ref)
    assert metrics["moe/routing_drift"] > 0.01  # the routers alone route elsewhere
    # the updates' routers against the sampler's record (what the replay overrode)
    assert metrics["moe/update_routing_drift"] > 0.01
    assert metrics["sampler_logp_gap_max"] < 1e-5, metrics["sampler_logp_gap_max"]
    # the log-prob passes: pi_old replays the sampler's record, the reference never does
    replayed = [(kw["routing"], out, plain) for _, kw, out, plain in calls if kw.get("routing")]
    assert [args[0] is ref for args, kw, *_ in calls if kw.get("routing") is None] == [True]
    if not run.settings.spec.old_logp:
        assert not replayed  # a single update replays in its own forward
        return
    ((experts, mask), old, plain), = replayed  # fmt: skip
    assert experts.dtype == np.uint8 and experts.shape[2:] == (2, 2)  # [B, S, M, K]
    # the prompt and every fed response token; the last response token was never fed
    assert 0 < mask.sum() < (experts[..., 0, 0] >= 0).sum()
    assert np.abs(old - plain).max() > 1e-2  # without the replay pi_old is another policy


def test_r2_replays_the_old_policy_routing_in_every_update():
    """R2 on packed groups, two minibatches at a high learning rate: the record each update
    replays is the routing of a full forward over its rows with the step's start parameters
    (the old-policy pass's, unpacked from the packed layout); the first update (still at those
    parameters) overrides nothing, the second, after the routers moved, does."""
    changes = {
        "algo.routing_replay": "r2",
        "algo.num_minibatches": 2,
        "optim.pack_groups": True,
        "optim.length_buckets": 2,
        "optim.lr": 3e-2,
    }
    # routers tied up to 1e-3: far above float noise (one routing for every pass at the same
    # parameters), far below what an update at this learning rate moves them by
    run, state, loop, ref = _moe_run("grpo", eps=1e-3, **changes)
    old = jax.tree.map(jnp.copy, state.params)  # the state's own buffers are donated
    calls, results = [], []
    real_update = run.updater.update

    def update(st, mb):
        calls.append(mb)
        st, m = real_update(st, mb)
        results.append(jax.device_get(m))
        return st, m

    run.updater.update = update
    state, metrics, _, _ = rl_step(run, state, loop, ref)
    assert len(calls) == 2
    model = run.model(old)
    for mb in calls:
        _, routes = model.hidden(jnp.asarray(mb.tokens), None, jnp.asarray(mb.valid),
                                 with_routes=True)  # fmt: skip
        full = np.moveaxis(np.asarray(routes.experts), 0, 2)  # [B, S, M, K]
        mask = mb.routing_mask > 0
        assert mask.sum() == (mb.valid > 0).sum()  # every real token recorded
        np.testing.assert_array_equal(np.asarray(mb.routing)[mask], full[mask])
    first, second = results
    assert first["routing_recorded"] > 0 and first["routing_drifted"] == 0
    assert second["routing_drifted"] > 0
    assert 0 < metrics["moe/update_routing_drift"] < 1


def test_routing_metrics_are_a_forward_at_the_steps_start():
    """The moe/* metrics come from the first update's own forward (no extra pass): they equal
    a full forward at the parameters the step starts from, against the sampler's record, over
    the tokens it routed (per layer: the share whose expert set changed, the busiest expert's
    load, the routers' entropy); the update packs its groups, so a shared prompt slot must
    count once per row. A bf16 sampler over fp32 updates, routers tied up to 1e-2: some tokens
    drift."""
    changes = {"rollout.compute_dtype": "bfloat16", "optim.pack_groups": True,
               "optim.length_buckets": 2}  # fmt: skip
    run, state, loop, ref = _moe_run("grpo", eps=1e-2, layers=2, **changes)
    start = jax.tree.map(jnp.copy, state.params)  # the state's own buffers are donated
    calls = []
    real_update = run.updater.update

    def update(st, mb):
        calls.append(mb)
        return real_update(st, mb)

    run.updater.update = update
    state, metrics, _, _ = rl_step(run, state, loop, ref)
    (mb,) = calls
    _, routes = run.model(start).hidden(jnp.asarray(mb.tokens), None, jnp.asarray(mb.valid),
                                        with_routes=True)  # fmt: skip
    own = np.sort(np.moveaxis(np.asarray(routes.experts), 0, 2), axis=-1)  # [B, S, M, K]
    record = np.sort(np.asarray(mb.routing).astype(np.int64), axis=-1)
    w = np.asarray(mb.routing_mask, np.float64)
    assert 0 < w.sum() < (np.asarray(mb.valid) > 0).sum()  # routed tokens, not every token
    drift = np.einsum("bsm,bs->m", np.any(own != record, axis=-1), w) / w.sum()
    assert drift.max() > 0, drift
    np.testing.assert_allclose(metrics["moe/routing_drift"], drift.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["moe/routing_drift_max"], drift.max(), rtol=1e-6)
    for m, layer in enumerate((0, 1)):
        counts = np.zeros(4)
        np.add.at(counts, own[:, :, m].reshape(-1), np.repeat(w.reshape(-1), 2))
        np.testing.assert_allclose(metrics[f"moe/load_max_over_mean/layer_{layer}"],
                                   counts.max() / counts.sum() * 4, rtol=1e-6)  # fmt: skip
    entropy = np.einsum("mbs,bs->m", np.asarray(routes.entropy), w) / w.sum()
    np.testing.assert_allclose(metrics["moe/router_entropy"], entropy.mean(), rtol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
def test_replayed_gates_keep_the_routers_gradient(normalize):
    """A replayed token's gates are this router's fp32 softmax at the recorded experts
    (renormalised over them with norm_topk_prob): the gradient of a function of the gates with
    respect to the router logits is that formula's, by float64 central differences, and is
    non-zero; where the mask is off the router's own top k is kept, and `drift` marks the
    recorded tokens whose record the router would not pick, replayed or not."""
    rng = np.random.default_rng(0)
    n, e, k = 5, 6, 2
    logits = rng.normal(size=(n, e)).astype(np.float32)
    forced = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.uint8)
    mask = np.array([True, True, False, True, True])
    c = rng.normal(size=(n, k))

    def formula(l_nxe):  # float64: softmax, gathered at the record, renormalised
        p = np.exp(l_nxe - l_nxe.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        own = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        chosen = np.where(mask[:, None], forced, own)
        g = np.take_along_axis(p, chosen, axis=-1)
        if normalize:
            g = g / g.sum(-1, keepdims=True)
        return float(np.sum(c * g))

    def gated(l_nxe, replay=mask):
        gates, experts, drift = moe.route(l_nxe, k, normalize=normalize,
                                          experts_NxK=jnp.asarray(forced), replay_N=replay,
                                          recorded_N=mask)  # fmt: skip
        return jnp.sum(c * gates), (experts, drift)

    (value, (experts, drift)), grad = jax.value_and_grad(gated, has_aux=True)(logits)
    np.testing.assert_allclose(value, formula(logits.astype(np.float64)), rtol=1e-5)
    own = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(experts, np.where(mask[:, None], forced, own))
    differs = np.any(np.sort(forced, -1) != np.sort(own, -1), -1) & mask
    np.testing.assert_array_equal(drift, differs.astype(np.float32))
    # recorded but not replayed: the router's own choice, the drift measured all the same
    _, (kept, measured) = gated(logits, replay=np.zeros_like(mask))
    np.testing.assert_array_equal(kept, own)
    np.testing.assert_array_equal(measured, drift)
    h, fd = 1e-6, np.zeros((n, e))
    for i in range(n):
        for j in range(e):
            up, down = logits.astype(np.float64), logits.astype(np.float64)
            up[i, j] += h
            down[i, j] -= h
            fd[i, j] = (formula(up) - formula(down)) / (2 * h)
    np.testing.assert_allclose(grad, fd, atol=1e-5, rtol=1e-4)
    assert np.abs(np.asarray(grad)[mask]).max() > 1e-3


def test_part_four_cells_are_the_designed_arms():
    """studies/moe (STUDY.md part 4): six cells of configs/moe_arith.py's MoE, each with its
    routing replay, the sampler in bf16 over an fp32 update, 4 updates per rollout and the
    same budget; each config valid and differing from the base only where its arm says; the
    pilot's ladder in order of growing drift."""
    from gvpo_jax import config as config_lib
    from studies import arms
    from studies.moe import study
    from studies.moe.configs import base

    cells = study.cells("bf16", quick=False)
    assert [c.name for c in cells] == list(study.CELLS)
    start = base.get_config()
    for cell in cells:
        c = cell.load()
        config_lib.validate(c, check_paths=False)
        algo, replay = study.CELLS[cell.name]
        assert (c.algo.name, c.algo.routing_replay) == (algo, replay)
        assert c.rollout.compute_dtype == "bfloat16" and c.model.compute_dtype == "float32"
        assert c.algo.num_minibatches * c.algo.num_epochs == 4
        assert c.model.overrides.architecture == "qwen3_moe"
        changed = {k for k, _ in arms.overrides(c, start)}
        assert changed <= {"algo.name", "algo.routing_replay"}, changed
    lrs = [base.moe_recipe(setting=s).optim.lr for s in base.SETTINGS]
    assert lrs == sorted(lrs) and list(base.SETTINGS)[0] == "bf16"
