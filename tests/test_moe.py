"""Mixture-of-experts policies (Qwen3-MoE): routing, the three dispatches, transformers parity,
decoding, export, presets and bad configs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gvpo_jax import models, sampler
from gvpo_jax.models import moe
from gvpo_jax.models.transformer import swiglu
from tests.helpers import MOE_OVERRIDES

TOL = 1e-4


def _make_hf(path, *, normalize: bool, seed: int):
    """A random Qwen3MoeForCausalLM: 3 layers, the middle one dense (mlp_only_layers), 6 experts
    of width 24, top-2, untied."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
        norm_topk_prob=normalize, rope_theta=7000.0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.15 * noise)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {n: (root / n, _make_hf(root / n, normalize=n == "norm", seed=i))
            for i, n in enumerate(("norm", "raw"))}  # fmt: skip


def _hf_logits(hf_model, tokens, mask=None):
    kw = {}
    if mask is not None:
        kw["attention_mask"] = torch.tensor(mask, dtype=torch.long)
        kw["position_ids"] = torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0), dtype=torch.long)
    with torch.no_grad():
        return hf_model(torch.tensor(tokens, dtype=torch.long), **kw).logits.float().numpy()


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 96, size=shape).astype(np.int32)


@pytest.mark.parametrize(("kind", "side"), [("norm", "none"), ("norm", "left"), ("raw", "right")])
def test_logits_equal_transformers_with_and_without_padding(checkpoints, kind, side):
    """norm_topk_prob both ways, one dense layer between MoE layers; padded rows' real tokens
    equal transformers' (right and left padding), each dispatch."""
    path, hf_model = checkpoints[kind]
    model = models.from_pretrained(path)
    cfg = model.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 6, 2)
    assert [cfg.moe_layer(i) for i in range(3)] == [True, False, True]
    assert cfg.norm_topk_prob == (kind == "norm")
    tokens, mask = _tokens((3, 9), seed=1), np.ones((3, 9), np.int32)
    if side != "none":
        for b, n in enumerate((9, 5, 2)):
            mask[b] = 0
            mask[b, :n] = 1 if side == "right" else 0
            if side == "left":
                mask[b, 9 - n :] = 1
    ref = _hf_logits(hf_model, tokens, None if side == "none" else mask)
    real = mask.astype(bool)
    forward = jax.jit(lambda m, x, k: m(x, mask_BxT=k))
    for dispatch in ("dense", "grouped", "ragged"):
        ours = models.with_config(model, moe_dispatch=dispatch)
        logits = np.asarray(forward(ours, jnp.asarray(tokens), jnp.asarray(mask)))
        np.testing.assert_allclose(logits[real], ref[real], atol=TOL, rtol=0, err_msg=dispatch)


def test_balance_loss_is_transformers_per_layer_on_every_update_path(checkpoints):
    """`moe.balance_loss` is transformers' `load_balancing_loss_func` of each MoE layer's router
    logits over the real tokens (left-padded prompts, right-padded responses), averaged over
    the layers; the shared-prompt and packed update paths give the same value and router
    gradient as the plain forward."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from gvpo_jax import buckets, train_step
    from gvpo_jax.batch import UpdateBatch

    path, hf_model = checkpoints["raw"]
    model = models.from_pretrained(path)
    g, j = 2, 3  # two groups of two responses behind 3 prompt slots
    tokens = np.array([[0, 5, 6, 10, 11, 12, 0], [0, 5, 6, 20, 0, 0, 0],
                       [7, 8, 9, 30, 31, 0, 0], [7, 8, 9, 40, 41, 42, 43]], np.int32)  # fmt: skip
    resp = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    mask = np.concatenate([[[0, 1, 1]] * 2 + [[1, 1, 1]] * 2, resp], axis=1).astype(np.float32)
    with torch.no_grad():
        out = hf_model(torch.tensor(tokens, dtype=torch.long),
                       attention_mask=torch.tensor(mask, dtype=torch.long),
                       position_ids=torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0),
                                                 dtype=torch.long),
                       output_router_logits=True)  # fmt: skip
    per_layer = [float(load_balancing_loss_func((logits,), 6, 2, torch.tensor(mask)))
                 for logits in out.router_logits]  # fmt: skip
    assert len(per_layer) == 2 and max(per_layer) > 2.0  # k = 2 when balanced: these are not
    graphdef, params = nnx.split(model)
    packed = buckets.pack(UpdateBatch(tokens=tokens, valid=mask, loss_mask=resp,
                                      rewards=np.zeros(4, np.float32)),
                          np.arange(4), 8, j, g).packed  # fmt: skip
    kw = dict(prompt_len=j, chunk_size=4, with_routes=True)
    paths = {
        "plain": lambda p: train_step.response_logprobs(graphdef, p, tokens, mask, **kw),
        "shared": lambda p: train_step.response_logprobs(
            graphdef, p, tokens, mask, group_size=g, **kw
        ),  # fmt: skip
        "packed": lambda p: train_step.packed_logprobs(graphdef, p, packed, group_size=g, **kw),
    }

    def balance(path_fn, p):
        return moe.balance_loss(path_fn(p)[1].balance)

    results = {
        name: jax.jit(jax.value_and_grad(functools.partial(balance, fn)))(params)
        for name, fn in paths.items()
    }
    value, grads = results["plain"]
    assert float(value) == pytest.approx(np.mean(per_layer), rel=1e-5)
    router = grads["layers"][0]["mlp"]["router_kernel"][...]
    assert float(jnp.abs(router).max()) > 1e-4  # the loss reaches the router
    for name in ("shared", "packed"):
        assert float(results[name][0]) == pytest.approx(float(value), rel=1e-5), name
        for a, b in zip(jax.tree.leaves(results[name][1]), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4, err_msg=name)


def _experts(seed, n=37, d=16, e=6, f=12, k=2):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(n, d)), jnp.float32)
    w = [
        jnp.asarray(0.3 * r.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))
    ]
    logits = jnp.asarray(r.normal(size=(n, e)), jnp.float32)
    return x, w, logits, k


@pytest.mark.parametrize("products", ["scan", "gathered"])
def test_dispatches_give_the_same_values_and_gradients(products, monkeypatch):
    """Dense reference == grouped (blocks of 4: several blocks per expert, partial ones; the
    blocks through `block_mlp`'s scan, laid out by the count, or by the products on
    gathered weights, laid out by the sort) == ragged_dot, for the outputs and the gradients
    of x, every expert weight and the router."""
    monkeypatch.setattr(moe, "SCAN_FROM_BLOCKS", 1 if products == "scan" else 10**9)
    monkeypatch.setattr(moe, "COUNT_UP_TO_EXPERTS", 64 if products == "scan" else 0)
    block = 4
    x, w, logits, k = _experts(0)

    def out(dispatch, x, w, logits):
        gates, experts, _ = moe.route(logits, k, normalize=True)
        args = (x, *w, gates, experts, swiglu)
        if dispatch == "grouped":
            return moe.grouped(*args, block=block)
        return getattr(moe, dispatch)(*args)

    def loss(dispatch, *a):
        return jnp.sum(jnp.sin(out(dispatch, *a)))

    def grad(dispatch):  # jitted: the scan's loops run op by op without it (several seconds)
        return jax.jit(jax.grad(functools.partial(loss, dispatch), argnums=(0, 1, 2)))

    ref = out("dense", x, w, logits)
    grads_ref = grad("dense")(x, w, logits)
    for dispatch in ("grouped", "ragged"):
        got = jax.jit(functools.partial(out, dispatch))(x, w, logits)
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
        grads = grad(dispatch)(x, w, logits)
        for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
            np.testing.assert_allclose(g, g_ref, atol=1e-5, rtol=0, err_msg=dispatch)


@pytest.mark.parametrize("layout", ["count", "sort"])
def test_grouped_layout_puts_each_expert_s_assignments_in_token_order_in_whole_blocks(
    layout, monkeypatch
):
    """`moe._padded_rows` by the running count and by the sort == a loop over the assignments:
    expert e's group starts where e - 1's group, padded to whole blocks, ends, and holds e's
    assignments in token order (expert 3 gets none: an empty group, no rows)."""
    monkeypatch.setattr(moe, "COUNT_UP_TO_EXPERTS", 64 if layout == "count" else 0)
    r = np.random.default_rng(3)
    e, block = 5, 4
    experts = np.stack([r.choice([0, 1, 2, 4], size=2, replace=False) for _ in range(23)])
    row, ends = moe._padded_rows(jnp.asarray(experts, jnp.int32), e, block)
    want_row, start, want_ends = np.zeros(experts.size, np.int64), 0, []
    for expert in range(e):
        mine = np.flatnonzero(experts.reshape(-1) == expert)
        want_row[mine] = start + np.arange(mine.size)
        start += -(-mine.size // block) * block
        want_ends.append(start)
    np.testing.assert_array_equal(np.asarray(row), want_row)
    np.testing.assert_array_equal(np.asarray(ends), want_ends)


def test_block_mlp_equals_the_gathered_products_in_values_and_gradients():
    """`moe.block_mlp` (one scan, each block through its expert's whole MLP, its own gradient
    rule) == the three batched products on `w[expert_B]` with the activation between, for the
    output and the gradients of x and the three weights; expert 2 owns no block (its weight
    gradients 0). In bf16 the weight gradients of an expert with 40 blocks are summed in fp32:
    within bf16's rounding of the float64 sums, not 40 roundings."""
    r = np.random.default_rng(7)
    expert_B = jnp.asarray([0, 0, 1, 3, 3, 3, 1], jnp.int32)
    x = jnp.asarray(r.normal(size=(7, 5, 6)), jnp.float32)
    ws = tuple(
        jnp.asarray(r.normal(size=s) * 0.5, jnp.float32) for s in [(4, 6, 3)] * 2 + [(4, 3, 6)]
    )
    g = jnp.asarray(r.normal(size=(7, 5, 6)), jnp.float32)

    def gathered(x, gate, up, down):
        h = swiglu(moe.gathered_matmul(x, gate, expert_B), moe.gathered_matmul(x, up, expert_B))
        return moe.gathered_matmul(h, down, expert_B)

    def mlp(x, *ws):
        return moe.block_mlp(x, *ws, expert_B, swiglu)

    np.testing.assert_allclose(mlp(x, *ws), gathered(x, *ws), atol=1e-5)
    every = (0, 1, 2, 3)
    want = jax.grad(lambda *a: jnp.sum(gathered(*a) * g), argnums=every)(x, *ws)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(mlp(*a) * g), argnums=every))(x, *ws)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert all(float(jnp.abs(dw[2]).max()) == 0.0 for dw in got[1:])

    many_B = jnp.zeros((40,), jnp.int32)
    xb = jnp.asarray(r.normal(size=(40, 8, 6)), jnp.bfloat16)
    gb = jnp.asarray(r.normal(size=(40, 8, 6)), jnp.bfloat16)
    up = jnp.asarray(r.normal(size=(1, 6, 3)), jnp.bfloat16)
    dw = jax.grad(lambda d: jnp.sum(moe.block_mlp(xb, up, up, d, many_B, swiglu) * gb))(
        jnp.zeros((1, 3, 6), jnp.bfloat16)
    )
    h = np.asarray(swiglu(xb @ up[0], xb @ up[0]), np.float64)  # the activations, in bf16
    exact = np.einsum("bmi,bmo->io", h, np.asarray(gb, np.float64))
    np.testing.assert_allclose(np.asarray(dw[0], np.float64), exact, rtol=2**-8, atol=1e-2)


def test_routing_is_dropless_when_every_token_picks_one_expert():
    """All 37 tokens routed to expert 3 (and their second choice): no capacity, so the grouped
    path (blocks of 4: 10 blocks for one expert) still equals the dense reference."""
    x, w, logits, k = _experts(1)
    logits = logits.at[:, 3].add(50.0)
    gates, experts, _ = moe.route(logits, k, normalize=False)
    assert (np.asarray(experts)[:, 0] == 3).all()
    ref = moe.dense(x, *w, gates, experts, swiglu)
    got = moe.grouped(x, *w, gates, experts, swiglu, block=4)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert float(jnp.abs(ref).min(axis=1).max()) > 0  # every token got its experts' output


def test_router_softmax_runs_in_fp32():
    """bf16 router logits (a bf16 model's): the gates are the fp32 softmax's probabilities of
    the top k (a softmax in bf16 is off by ~1e-3), renormalised in fp32."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(16, 8)), jnp.bfloat16)
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32)), np.float64)
    for normalize in (False, True):
        gates, experts, _ = moe.route(logits, 2, normalize=normalize)
        assert gates.dtype == jnp.float32 and experts.dtype == jnp.int32
        want = np.take_along_axis(probs, np.argsort(-probs, axis=1)[:, :2], axis=1)
        if normalize:
            want = want / want.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(gates, want, rtol=1e-6)


def test_grouped_block_size_follows_the_mean_group():
    assert moe.block_size(65536, 128, 64) == 64  # training: capped
    assert moe.block_size(512, 128, 64) == 8  # a decode step: 4 per expert on average, min 8
    assert moe.block_size(40, 4, 64) == 16


@pytest.mark.parametrize("num_slots", [0, 2], ids=["static", "continuous"])
def test_greedy_generation_matches_transformers_generate(checkpoints, num_slots):
    path, hf_model = checkpoints["raw"]
    model = models.from_pretrained(path)
    prompts, n = [[5, 17, 42], [7, 8, 9, 10, 11, 12], [60], [3, 4, 4, 60, 61]], 8
    ids, lens = sampler.pad_prompts(prompts, (8,))
    settings = sampler.SamplingSettings(max_new_tokens=n, temperature=0.0, num_slots=num_slots)
    out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(0))
    for row, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out.tokens_BxN[row]), ref[0, len(prompt) :])


def test_export_round_trip_loads_in_transformers(checkpoints, tmp_path):
    """Per-expert tensors on disk (mlp.experts.M.*_proj and the router mlp.gate), which
    transformers loads into its fused experts; the logits survive the trip."""
    path, hf_model = checkpoints["norm"]
    model = models.from_pretrained(path)
    out = models.save_pretrained(model, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = _tokens((2, 7), seed=3)
    np.testing.assert_allclose(_hf_logits(back, tokens), _hf_logits(hf_model, tokens),
                               atol=1e-6, rtol=0)  # fmt: skip
    names = {m.hf_name for m in models.tensor_maps(model.config)}
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    assert "model.layers.2.mlp.gate.weight" in names


def test_scanned_moe_layers_equal_unrolled_and_load_the_same_checkpoint(tmp_path):
    """Every layer MoE: the stacked [L, E, ...] expert weights load from the per-expert
    tensors and give the unrolled model's logits and gradients; a mixed dense / MoE layer
    pattern refuses the scan in one sentence."""
    cfg = models.PRESETS["tiny-moe"]
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    path = models.save_pretrained(model, tmp_path / "m")
    scanned = models.from_pretrained(path, scan_layers=True)
    assert scanned.layers.mlp.gate_kernel.shape == (2, 8, 64, 32)
    tokens = jnp.asarray(_tokens((2, 6), seed=4) % 256)

    @nnx.jit
    def value_and_grad(m):
        return nnx.value_and_grad(lambda m: jnp.sum(m(tokens)[..., :5] ** 2))(m)

    (v_unrolled, g_unrolled), (v_scanned, g_scanned) = (
        value_and_grad(model),
        value_and_grad(scanned),
    )
    np.testing.assert_allclose(v_scanned, v_unrolled, rtol=1e-5)
    g_unrolled = g_unrolled.layers[1].mlp.down_kernel[...]
    g_scanned = g_scanned.layers.mlp.down_kernel[...][1]
    np.testing.assert_allclose(g_scanned, g_unrolled, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scan_layers=True with both dense and MoE layers"):
        cfg.replace(mlp_only_layers=(1,), scan_layers=True)


QWEN3_30B_A3B = 30_532_122_624  # transformers' Qwen3MoeForCausalLM at the published shapes


def test_qwen3_30b_a3b_preset_counts_transformers_parameters():
    """eval_shape's count == transformers' meta-device count of the published config (48 MoE
    layers of 128 experts, top-8, untied), and its active parameters per token."""
    cfg = models.PRESETS["qwen3-30b-a3b"]
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        hf_model = transformers.Qwen3MoeForCausalLM(hf_cfg)
    assert sum(p.numel() for p in hf_model.parameters()) == QWEN3_30B_A3B
    assert models.abstract_model(cfg).num_params() == QWEN3_30B_A3B


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(num_experts_per_tok=9), "route each token to between 1 and 8 experts"),
        (dict(moe_intermediate_size=0), "set each expert's MLP width"),
        (dict(mlp_only_layers=(0, 1)), "leave no MoE layer"),
        (dict(mlp_only_layers=(5,)), "list distinct layer indices in"),
        (dict(moe_dispatch="capacity"), "use one of auto, dense, grouped, ragged"),
        (dict(architecture="qwen3"), "experts need architecture='qwen3_moe'"),
    ],
)
def test_bad_moe_configs_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        models.PRESETS["tiny-moe"].replace(**changes)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 with num_experts=6"),
        ({"capacity_factor": 1.25}, "capacity-limited routing"),
    ],
)
def test_bad_moe_checkpoints_give_one_sentence(checkpoints, tmp_path, edit, message):
    import json
    import shutil

    src = checkpoints["norm"][0]
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    hf = json.loads((dst / "config.json").read_text())
    hf.update(edit)
    (dst / "config.json").write_text(json.dumps(hf))
    with pytest.raises(models.CheckpointError, match=message):
        models.from_pretrained(dst)


def test_a_missing_expert_tensor_is_named(checkpoints, tmp_path):
    from gvpo_jax.models import safetensors_io

    src = checkpoints["norm"][0]
    dst = tmp_path / "missing"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    f = safetensors_io.SafetensorsFile(src / "model.safetensors")
    gone = "model.layers.2.mlp.experts.4.up_proj.weight"
    kept = [(n, tuple(f.header[n]["shape"]), np.float32, lambda n=n: f.read(n))
            for n in f.keys() if n != gone]  # fmt: skip
    safetensors_io.write_file(dst / "model.safetensors", kept)
    with pytest.raises(models.CheckpointError, match=f"missing tensor '{gone}'"):
        models.from_pretrained(dst)


@pytest.mark.parametrize("algo", ["gspo+packed+lora", "gvpo+experts"])
def test_rl_steps_on_an_moe_policy(algo):
    """Two trainer steps on an MoE policy: GSPO with two minibatches, packed groups, LoRA
    adapters and the router's balance loss (the log-prob pass and the packed update recompute
    each token's routing), and GVPO
    (the shared-prompt update) with the experts split over a 2-device expert axis
    (`mesh.expert`): the policy changes, every metric is finite, and the sampler's log-probs
    and routing equal the update's."""
    from gvpo_jax.rl_step import rl_step
    from tests.test_train import _flat, make_run, toy_config

    algo, *extras = algo.split("+")
    changes = dict(MOE_OVERRIDES)
    if algo != "gvpo":
        changes["algo.num_minibatches"] = 2
    if "lora" in extras:
        changes.update(
            {"lora.enabled": True, "lora.rank": 4, "optim.lr": 1e-2, "lora.experts": True}
        )
    if "experts" in extras:
        changes.update({"mesh.num_devices": 2, "mesh.data": 1, "mesh.expert": 2})
    if "packed" in extras:
        changes.update({"optim.length_buckets": 2, "optim.pack_groups": True})
        changes["algo.router_aux_loss_coef"] = 0.01  # the balance loss on the packed path
    run, state, loop, ref = make_run(toy_config(algo, **changes))
    cfg = run.model(state.params).config
    assert cfg.moe and cfg.num_experts == 4
    if "experts" in extras:  # each device holds 2 of the 4 experts
        gate = state.params["layers"][0]["mlp"]["gate_kernel"].get_value()
        assert {s.data.shape[0] for s in gate.addressable_shards} == {2}
    before = _flat(state.params)
    for _ in range(2):
        state, metrics, _, _ = rl_step(run, state, loop, ref)
    after = _flat(state.params)
    assert np.isfinite(after).all() and np.abs(after - before).max() > 1e-5
    for key in ("reward_mean", "loss", "grad_norm", "entropy_mc"):
        assert np.isfinite(metrics[key]), key
    assert metrics["sampler_logp_gap_max"] < 1e-4
    # the routing the sampler recorded is the update's, before the update moves it
    assert metrics["moe/routing_drift"] == 0.0
    if algo == "gvpo":  # one update, from the sampler's parameters: its routing is the same
        assert metrics["moe/update_routing_drift"] == 0.0
    assert 0.0 <= metrics["moe/update_routing_drift"] < 0.5
    assert 1.0 <= metrics["moe/load_max_over_mean"] <= metrics["moe/load_max_over_mean_max"] <= 4
    assert 0.0 < metrics["moe/router_entropy"] <= np.log(4) + 1e-6
    assert metrics["moe/load_max_over_mean/layer_0"] == metrics["moe/load_max_over_mean"]
    if "packed" in extras:  # 2 (top-k) when balanced, up to 4 (E) when one expert takes all
        assert 1.0 < metrics["router_balance_loss"] <= 4.0
    else:
        assert "router_balance_loss" not in metrics


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_routes_are_recorded_and_replay_gives_the_same_values_and_gradients(scan, tmp_path):
    """`hidden(with_routes=True)` gives each MoE layer's experts per token [M, B, T, K];
    replaying them gives the same hidden states and gradients (router included), with remat
    too; replaying another routing changes the output while the router keeps a gradient."""
    cfg = models.PRESETS["tiny-moe"].replace(num_layers=3, scan_layers=scan)
    model = models.Transformer(cfg, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(_tokens((2, 7), seed=6))
    hidden, routes = jax.jit(lambda m, x: m.hidden(x, with_routes=True))(model, tokens)
    assert routes.entropy.shape == (3, 2, 7) and float(routes.entropy.min()) > 0
    assert float(routes.entropy.max()) <= np.log(8) + 1e-6
    routes = routes.experts
    assert routes.shape == (3, 2, 7, 2) and routes.dtype == jnp.int32
    assert int(routes.min()) >= 0 and int(routes.max()) < 8
    graphdef, state = nnx.split(model)

    def loss(state, routing, remat=False):
        m = models.with_config(nnx.merge(graphdef, state), remat=remat)
        return jnp.sum(jnp.sin(m.hidden(tokens, routing=routing)))

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)
    routed, g_routed = value_and_grad(state, None, False)
    for remat in (False, True) if scan else (False,):
        replayed, g_replayed = value_and_grad(state, routes, remat)
        np.testing.assert_allclose(replayed, routed, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g_replayed), jax.tree.leaves(g_routed), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)  # fp32 sums' order
    other = (routes + 1) % 8  # every token to other experts
    moved, router = value_and_grad(state, other, False)
    assert abs(float(moved) - float(routed)) > 1e-3
    router = router["layers"]
    router = router["mlp"]["router_kernel"] if scan else router[0]["mlp"]["router_kernel"]
    assert float(jnp.abs(router[...]).max()) > 0


def test_prefill_then_decode_equals_the_full_forward_in_logits_and_routes(checkpoints):
    """A cached prefill and then one decode step per token give the logits and the routing of
    one forward over the whole sequence (the sampler's record is the update's)."""
    model = models.from_pretrained(checkpoints["norm"][0])
    tp, steps = 5, 3
    tokens = jnp.asarray(_tokens((2, tp + steps), seed=2))
    pos = jnp.broadcast_to(jnp.arange(tp + steps, dtype=jnp.int32), (2, tp + steps))
    full_logits, (_, full) = jax.jit(lambda m, x: (m(x), m.hidden(x, with_routes=True)))(
        model, tokens
    )
    call = jax.jit(lambda m, x, p, c, i: m(x, p, cache=c, cache_index=i, with_routes=True))
    logits, cache, routes = call(model, tokens[:, :tp], pos[:, :tp], model.init_cache(2, 10), 0)
    np.testing.assert_allclose(logits, full_logits[:, :tp], atol=TOL, rtol=0)
    parts = [routes.experts]
    for t in range(tp, tp + steps):
        step, cache, routes = call(model, tokens[:, t : t + 1], pos[:, t : t + 1], cache, t)
        np.testing.assert_allclose(step[:, 0], full_logits[:, t], atol=TOL, rtol=0)
        parts.append(routes.experts)
    np.testing.assert_array_equal(jnp.concatenate(parts, axis=2), full.experts)


@pytest.mark.parametrize("mode", ["static", "shed", "continuous"])
def test_sampler_records_the_routes_a_full_forward_gives(mode):
    """With record_routes the sampler returns each prompt token's and each fed-back response
    token's experts in every MoE layer (uint8), equal to a forward over the row's prompt and
    response; the static batch, its shedding and continuous batching record alike, and rows
    of every length (EOS ids make some end early) are lined up."""
    cfg = models.PRESETS["tiny-moe"]
    model = models.Transformer(cfg, rngs=nnx.Rngs(3))
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11, 12], [60], [3, 4, 4, 60, 61]]
    ids, lens = sampler.pad_prompts(prompts, (8,))
    settings = sampler.SamplingSettings(
        max_new_tokens=6, group_size=2, temperature=1.0, eos_ids=tuple(range(0, 256, 9)),
        num_slots=3 if mode == "continuous" else 0, shed=2 if mode == "shed" else 0,
        record_routes=True,
    )  # fmt: skip
    out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(4))
    if mode == "static":
        plain = dataclasses.replace(settings, record_routes=False)
        plain = sampler.generate(model, ids, lens, plain, rng=jax.random.key(4))
        np.testing.assert_array_equal(out.tokens_BxN, plain.tokens_BxN)  # recording: no change
        assert plain.routes_BxNxMxK is None and plain.prompt_routes_PxTxMxK is None
    assert out.routes_BxNxMxK.dtype == jnp.uint8 and out.routes_BxNxMxK.shape == (8, 6, 2, 2)
    lengths = np.asarray(out.lengths_B)
    assert len(set(lengths.tolist())) > 1  # rows of several lengths
    # every row's prompt + response, right-padded, in one forward
    rows = np.zeros((8, 12), np.int32)
    mask = np.zeros((8, 12), np.int32)
    for b in range(8):
        prompt, n = prompts[b // 2], int(lengths[b])
        rows[b, : len(prompt) + n] = np.concatenate([prompt, np.asarray(out.tokens_BxN[b, :n])])
        mask[b, : len(prompt) + n] = 1
    _, full = jax.jit(lambda m, x, k: m.hidden(x, None, k, with_routes=True))(model, rows, mask)
    full = np.asarray(full.experts).transpose(1, 2, 0, 3)  # [B, T, M, K]
    for b in range(8):
        prompt, n = prompts[b // 2], int(lengths[b])
        recorded = np.asarray(out.prompt_routes_PxTxMxK[b // 2, : len(prompt)])
        np.testing.assert_array_equal(recorded, full[b, : len(prompt)])
        fed = np.asarray(out.routes_BxNxMxK[b, : n - 1])
        np.testing.assert_array_equal(fed, full[b, len(prompt) : len(prompt) + n - 1], err_msg=b)
        assert not np.asarray(out.routes_BxNxMxK[b, n - 1 :]).any()  # never fed: 0


def test_routing_sums_and_metrics_against_a_count_by_hand():
    """`moe.routing_sums` weights every (token, layer) by the record's mask (a packed prompt
    slot by its rows): drift where the record's expert set differs (not its order), the load
    of the experts used, the routers' entropy; `routing.metrics` divides them per layer;
    `routing.record_drift` compares two records on the host."""
    from gvpo_jax import routing

    r = np.random.default_rng(8)
    m, b, s, k, e = 2, 3, 5, 2, 4
    experts = np.stack([np.stack([r.choice(e, k, replace=False) for _ in range(b * s)])
                        for _ in range(m)]).reshape(m, b, s, k)  # fmt: skip
    drift = (r.random((m, b, s)) > 0.7).astype(np.float32)
    entropy = r.random((m, b, s)).astype(np.float32)
    weight = np.round(r.random((b, s)) * 3)  # 0 (not recorded) to 3 (a slot of 3 rows)
    balance = moe.Balance(jnp.zeros(1), jnp.zeros((1, e)), jnp.zeros((1, e)))
    routes = moe.Routes(jnp.asarray(experts), jnp.asarray(entropy), balance, jnp.asarray(drift))
    sums = jax.device_get(moe.routing_sums(routes, jnp.asarray(weight)))
    out = routing.metrics(sums, float(weight.sum()), [1, 3])
    loads = []
    for layer in range(m):
        counts = np.zeros(e)
        for bi in range(b):
            for si in range(s):
                counts[experts[layer, bi, si]] += weight[bi, si]
        np.testing.assert_allclose(sums["counts"][layer], counts, rtol=1e-6)
        loads.append(counts.max() / counts.sum() * e)
    np.testing.assert_allclose(out["moe/load_max_over_mean/layer_3"], loads[1], rtol=1e-6)
    np.testing.assert_allclose(out["moe/load_max_over_mean_max"], max(loads), rtol=1e-6)
    want = [(drift[i] * weight).sum() / weight.sum() for i in range(m)]
    np.testing.assert_allclose(out["moe/routing_drift"], np.mean(want), rtol=1e-6)
    np.testing.assert_allclose(out["moe/routing_drift_max"], np.max(want), rtol=1e-6)
    want = np.mean([(entropy[i] * weight).sum() / weight.sum() for i in range(m)])
    np.testing.assert_allclose(out["moe/router_entropy"], want, rtol=1e-6)
    # two records of [B, S, M, K]: the same sets reordered, one token changed, one not fed
    recorded = experts.transpose(1, 2, 0, 3)[..., ::-1].copy()
    other = recorded.copy()
    other[0, 1, 0] = [(experts[0, 0, 1, 0] + 1) % e, experts[0, 0, 1, 0]]
    other[2, 4, 1] = (experts[1, 2, 4] + 1) % e
    fed = np.ones((b, s))
    fed[2, 4] = 0.0
    assert set(other[0, 1, 0].tolist()) != set(recorded[0, 1, 0].tolist())
    np.testing.assert_allclose(routing.record_drift(recorded, other.astype(np.uint8), fed),
                               [1 / fed.sum(), 0.0])  # fmt: skip


def test_stale_moe_rollouts_measure_routing_drift_and_carry_routes_in_the_queue():
    """Rollouts sampled 2 updates before they train (rollout.staleness), computing in bf16 over
    fp32 masters, carry their routing through the queue; after updates at a high learning rate
    some tokens' experts changed, and R3 (`algo.routing_replay`) replays the stale record in
    the update, overriding the router there."""
    from gvpo_jax.rl_step import rl_step
    from tests.test_train import make_run, toy_config

    changes = dict(MOE_OVERRIDES, **{"rollout.staleness": 2, "optim.lr": 3e-2,
                                     "model.compute_dtype": "bfloat16",
                                     "algo.routing_replay": "r3"})  # fmt: skip
    run, state, loop, ref = make_run(toy_config("gvpo", **changes))
    drift, at_update = [], []
    for _ in range(4):
        state, metrics, _, _ = rl_step(run, state, loop, ref)
        drift.append(metrics["moe/routing_drift"])
        at_update.append(metrics["moe/update_routing_drift"])
    assert all("routes" in q.batch for q in loop.queue)
    assert drift[0] < 0.05 and max(drift[2:]) > drift[0], drift  # bf16: the first is near 0
    assert max(at_update[2:]) > at_update[0], at_update  # the record R3 replays: stale
    # train.routing_metrics=false: no moe/* metrics but the updates' drift, routes still recorded
    quiet = dataclasses.replace(run.settings, routing_metrics=False)
    state, metrics, _, _ = rl_step(dataclasses.replace(run, settings=quiet), state, loop, ref)
    assert [k for k in metrics if k.startswith("moe/")] == ["moe/update_routing_drift"]  # free
    assert all("routes" in q.batch for q in loop.queue)


def test_a_mixed_layer_pattern_stays_unrolled_on_auto_and_refuses_an_explicit_scan():
    """Dense and MoE layers mixed: model.scan_layers=auto (on for TPU / GPU, as the planner
    plans) resolves to the unrolled layers; an explicit true is one sentence naming the field."""
    from gvpo_jax import config as config_lib
    from gvpo_jax import plan

    c = config_lib.base_config()
    c.model.preset = "tiny-moe"
    c.model.overrides.mlp_only_layers = (1,)
    assert not plan.model_config(c).scan_layers
    c.model.overrides = {}
    assert plan.model_config(c).scan_layers  # all MoE: scanned on an accelerator
    c.model.overrides.mlp_only_layers = (1,)
    c.model.scan_layers = "true"
    with pytest.raises(config_lib.ConfigError, match="scan_layers is true but the model mixes"):
        plan.model_config(c)


def test_moe_arith_config_is_the_demo_recipe_with_a_qwen3_moe_model():
    from configs import arith_tiny, moe_arith
    from gvpo_jax import config as config_lib
    from gvpo_jax import plan

    c = moe_arith.get_config()
    config_lib.validate(c)
    cfg = plan.model_config(c)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert all(cfg.moe_layer(i) for i in range(cfg.num_layers)) and cfg.norm_topk_prob
    demo = arith_tiny.get_config()
    for group in ("algo", "rollout", "optim", "sft", "data", "train"):
        assert c[group].to_dict() == demo[group].to_dict(), group


def test_an_expert_axis_that_does_not_divide_the_experts_is_one_sentence():
    from gvpo_jax import config as config_lib
    from tests.test_train import make_run, toy_config

    c = toy_config("gvpo", **MOE_OVERRIDES)
    c.mesh.expert = 0
    with pytest.raises(config_lib.ConfigError, match="config.mesh.expert is 0"):
        config_lib.validate(c)
    mesh = {"mesh.num_devices": 8, "mesh.data": 1, "mesh.expert": 8}
    c = toy_config("gvpo", **MOE_OVERRIDES, **mesh, **{"rollout.prompts_per_step": 8})
    with pytest.raises(Exception, match="num_experts=4 is not divisible by mesh axis 'expert'"):
        make_run(c)
    # the router's balance loss needs a router, and a coefficient that is not negative
    with pytest.raises(config_lib.ConfigError, match="router_aux_loss_coef is 0.01 but the model"):
        make_run(toy_config("gvpo", **{"algo.router_aux_loss_coef": 0.01}))
    lora = {"lora.enabled": True, "lora.rank": 2, "lora.experts": True}
    with pytest.raises(config_lib.ConfigError, match="config.lora.experts is true but the model"):
        make_run(toy_config("gvpo", **lora))
    with pytest.raises(config_lib.ConfigError, match="config.algo.router_aux_loss_coef is -1.0;"):
        toy_config("gvpo", **MOE_OVERRIDES, **{"algo.router_aux_loss_coef": -1.0})
    # routing replay needs a router, a known mode, and R2 an update after the first
    with pytest.raises(config_lib.ConfigError, match="routing_replay is 'r3' but the model has"):
        make_run(toy_config("gvpo", **{"algo.routing_replay": "r3"}))
    with pytest.raises(config_lib.ConfigError, match="routing_replay is 'r4'; use none, r2 or r3"):
        toy_config("gvpo", **MOE_OVERRIDES, **{"algo.routing_replay": "r4"})
    with pytest.raises(config_lib.ConfigError, match="a step makes one update .* nothing to"):
        toy_config("gvpo", **MOE_OVERRIDES, **{"algo.routing_replay": "r2"})
