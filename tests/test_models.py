"""Model tests: logit parity with transformers, KV cache, export round trip, errors, presets."""

import copy
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gvpo_jax import models, sampler
from gvpo_jax.models.cache import layer as layer_cache

TOL = 1e-4


def _randomise(hf_model, seed):
    """Every parameter random (norm scales around 1, biases non-zero) so no term is trivial.
    Gemma's norms multiply by (1 + weight): their weights are drawn around 0."""
    gen = torch.Generator().manual_seed(seed)
    one = 0.0 if "Gemma" in type(hf_model).__name__ else 1.0
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(one + 0.3 * noise if "norm" in name else 0.15 * noise)


def _make_hf(kind, path):
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    if kind.startswith("gemma3"):
        # Sliding window 4 on layers 0-1 (RoPE base 700), a full layer 2 (base 30000), and a
        # query scalar (24) that is not head_dim (16): every Gemma 3 setting is exercised, and
        # the 9-13 token sequences below are longer than the window.
        cfg = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=4,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 30000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 700.0},
            },
            max_position_embeddings=2048,
        )  # fmt: skip
        model = transformers.Gemma3ForCausalLM(cfg)
    elif kind == "llama":
        # Explicit head_dim != hidden/heads and a non-default eps and theta.
        cfg = transformers.LlamaConfig(**common, head_dim=16, rms_norm_eps=1e-5, rope_theta=20000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind.startswith("qwen3"):
        # QK-norm, no bias, explicit head_dim with N*H = 64 != D = 32 (Qwen3-0.6B: 2048 vs 1024).
        cfg = transformers.Qwen3Config(
            **common, head_dim=16, rope_theta=7000.0, tie_word_embeddings=(kind == "qwen3-tied")
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(
            **common, rope_theta=5000.0, tie_word_embeddings=(kind == "qwen2-tied")
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    _randomise(model, seed=len(kind))
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    kinds = ("qwen2-tied", "qwen2-untied", "llama", "qwen3-tied", "qwen3-untied", "gemma3-tied")
    return {k: (root / k, _make_hf(k, root / k)) for k in kinds}


def _hf_logits(hf_model, tokens, mask=None, positions=None):
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(mask, dtype=torch.long)
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(positions, dtype=torch.long)
    with torch.no_grad():
        return hf_model(torch.tensor(tokens, dtype=torch.long), **kwargs).logits.float().numpy()


def _tokens(shape, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


@pytest.mark.parametrize(
    "kind", ["qwen2-tied", "qwen2-untied", "llama", "qwen3-tied", "qwen3-untied", "gemma3-tied"]
)
def test_logit_parity_with_transformers(checkpoints, kind):
    path, hf_model = checkpoints[kind]
    model = models.from_pretrained(path, "float32")
    assert model.config.tie_word_embeddings == kind.endswith("-tied")
    assert model.config.qk_norm == kind.startswith(("qwen3", "gemma3"))
    assert model.config.architecture == kind.split("-")[0]
    tokens = _tokens((2, 11))
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert ours.dtype == np.float32 and ours.shape == (2, 11, 96)
    np.testing.assert_allclose(ours, _hf_logits(hf_model, tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2-untied", "llama", "qwen3-tied", "gemma3-tied"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_logit_parity_padded_batches(checkpoints, kind, side):
    path, hf_model = checkpoints[kind]
    model = models.from_pretrained(path)
    lengths, t = [9, 5, 1], 9
    tokens = _tokens((3, t), seed=1)
    mask = np.zeros((3, t), np.int32)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, t - n :] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = np.asarray(model(jnp.asarray(tokens), mask_BxT=jnp.asarray(mask)))  # default positions
    ref = _hf_logits(hf_model, tokens, mask, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=TOL, rtol=0)
    # Pad ids are invisible, even out-of-range ones.
    junk = np.asarray(model(jnp.asarray(np.where(real, tokens, -1)), mask_BxT=jnp.asarray(mask)))
    assert np.isfinite(junk).all()
    np.testing.assert_allclose(junk[real], ours[real], atol=1e-6, rtol=0)
    # Each padded row also equals the unpadded forward of its real tokens alone.
    for b in range(len(lengths)):
        alone = np.asarray(model(jnp.asarray(tokens[b][real[b]][None])))[0]
        np.testing.assert_allclose(ours[b][real[b]], alone, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama", "qwen3-untied", "gemma3-tied"])
def test_cache_prefill_then_decode_equals_full_forward(checkpoints, kind):
    """Right-padded prompts prefilled at slots [0, Tp); decode step n writes slot Tp+n."""
    model = models.from_pretrained(checkpoints[kind][0])
    tp, steps, s = 6, 3, 12
    prompt_lens = np.array([6, 3])
    tokens = _tokens((2, tp + steps), seed=2)
    prompt = tokens[:, :tp].copy()
    prompt_mask = (np.arange(tp)[None] < prompt_lens[:, None]).astype(np.int32)
    prompt_pos = np.maximum(np.cumsum(prompt_mask, 1) - 1, 0).astype(np.int32)

    @jax.jit
    def step(graphdef, state, toks, pos, m, cache, i):
        mdl = nnx.merge(graphdef, state)
        return mdl(toks, positions_BxT=pos, mask_BxT=m, cache=cache, cache_index=i)

    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, s)
    assert (
        layer_cache(cache, 0).k.shape == (2, 2, s, model.config.head_dim)
        and layer_cache(cache, 0).valid.dtype == bool
    )
    logits, cache = step(graphdef, state, prompt, prompt_pos, prompt_mask, cache, 0)
    decoded = []
    for n in range(steps):
        tok = tokens[:, tp + n][:, None]
        pos = (prompt_lens + n)[:, None].astype(np.int32)
        step_logits, cache = step(
            graphdef, state, tok, pos, np.ones((2, 1), np.int32), cache, jnp.int32(tp + n)
        )
        decoded.append(np.asarray(step_logits)[:, 0])
    for b in range(2):
        # The same row without padding: real prompt tokens then the decoded tokens.
        seq = np.concatenate([prompt[b, : prompt_lens[b]], tokens[b, tp:]])
        full = np.asarray(model(jnp.asarray(seq[None])))[0]
        n_p = prompt_lens[b]
        np.testing.assert_allclose(np.asarray(logits)[b, :n_p], full[:n_p], atol=TOL, rtol=0)
        for n in range(steps):
            np.testing.assert_allclose(decoded[n][b], full[n_p + n], atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2-untied", "gemma3-tied"])
@pytest.mark.parametrize("decode", [False, True], ids=["slots-inner", "slots-last"])
def test_shared_prefix_cache_decode_equals_full_forward(checkpoints, decode, kind):
    """P=2 right-padded prompts prefilled once, G=3 continuations each through
    `share_prefix_cache` (both layouts): every step's logits equal the full forward of prompt +
    continuation (gemma3: the last steps' windows leave the prompt's first tokens out)."""
    model = models.from_pretrained(checkpoints[kind][0])
    p, g, tp, steps = 2, 3, 6, 3
    prompt = _tokens((p, tp), seed=5)
    lens = np.array([6, 3])
    valid = np.arange(tp)[None] < lens[:, None]
    pos = np.broadcast_to(np.arange(tp), (p, tp)).astype(np.int32)
    _, cache = model(jnp.asarray(prompt), pos, valid, cache=model.init_cache(p, tp), cache_index=0)
    cache = model.share_prefix_cache(cache, g, steps, decode=decode)
    if decode:  # keys and values slot-last: [P, K, H, J] and [P, K, R, H, S]
        h = model.config.head_dim
        assert layer_cache(cache, 0).prefix_k.shape == (p, 2, h, tp)
        assert layer_cache(cache, 0).k.shape == layer_cache(cache, 0).v.shape == (p, 2, g, h, steps)
    else:
        assert layer_cache(cache, 0).prefix_k.shape[0] == p and layer_cache(cache, 0).k.shape[
            :4
        ] == (p, 2, g, steps)
    cont = _tokens((p * g, steps), seed=6)
    decoded = []
    for n in range(steps):
        pos_n = (np.repeat(lens, g) + n)[:, None].astype(np.int32)
        logits, cache = model(
            jnp.asarray(cont[:, n : n + 1]), pos_n, np.ones((p * g, 1), bool), cache=cache,
            cache_index=n,
        )  # fmt: skip
        decoded.append(np.asarray(logits)[:, 0])
    for row in range(p * g):
        seq = np.concatenate([prompt[row // g, : lens[row // g]], cont[row]])
        full = np.asarray(model(jnp.asarray(seq[None])))[0]
        for n in range(steps):
            np.testing.assert_allclose(decoded[n][row], full[lens[row // g] + n], atol=TOL, rtol=0)


def _grouped_rows(p, g, tp, n, vocab, seed):
    """P prompts left-padded to tp (lengths 1..tp), each repeated for G rows, then responses of
    ragged lengths (1..n, right-padded): the trainer's rollout layout."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (p * g, tp + n)).astype(np.int32)
    tokens[:, :tp] = tokens[::g, :tp].repeat(g, axis=0)
    plen = np.array([tp, 1, *rng.integers(1, tp + 1, p - 2)]).repeat(g)
    rlen = np.array([n, 1, *rng.integers(1, n + 1, p * g - 2)])
    mask = np.zeros((p * g, tp + n), np.int32)
    for row in range(p * g):
        mask[row, tp - plen[row] : tp + rlen[row]] = 1
    return jnp.asarray(tokens * mask), jnp.asarray(mask)


@pytest.mark.parametrize("kind", ["qwen2-untied", "qwen3-untied", "gemma3-tied", "gemma3-blocked"])
def test_hidden_shared_prefix_equals_hidden_values_and_gradients(checkpoints, kind):
    """Each group's prompt run once (shared keys / values) gives the full forward's hidden
    states at every real slot, and the same parameter gradients (gemma3: through the sliding
    window, with the dense kernels and with the blocked ones)."""
    model = models.from_pretrained(checkpoints[kind.replace("blocked", "tied")][0])
    if kind.endswith("blocked"):
        model = models.with_config(model, attention="blocked")
    p, g, tp, n = 3, 4, 5, 6
    tokens, mask = _grouped_rows(p, g, tp, n, model.config.vocab_size, seed=11)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(p * g, tp + n, 1)), jnp.float32)
    weights = weights * mask[..., None]

    def run(shared):
        def loss(m):
            if shared:
                h = m.hidden_shared_prefix(tokens, mask, prefix_len=tp, group_size=g)
            else:
                h = m.hidden(tokens, None, mask)
            return jnp.sum(weights * jnp.sin(h)), h

        return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)

    (_, full), full_grads = run(False)
    (_, shared), shared_grads = run(True)
    real = np.asarray(mask, bool)
    assert shared.shape == full.shape
    np.testing.assert_allclose(np.asarray(shared)[real], np.asarray(full)[real], atol=TOL, rtol=0)
    for a, b in zip(jax.tree.leaves(shared_grads), jax.tree.leaves(full_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)  # fp32 sums in another order
    with pytest.raises(ValueError, match="whole groups of 5"):
        model.hidden_shared_prefix(tokens, mask, prefix_len=tp, group_size=5)


def test_hidden_with_cache_and_unembed_match_call(checkpoints):
    model = models.from_pretrained(checkpoints["qwen2-untied"][0])
    tokens = jnp.asarray(_tokens((2, 5), seed=3))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    hidden, cache = model.hidden(tokens, pos, cache=model.init_cache(2, 8), cache_index=0)
    logits, _ = model(tokens, pos, cache=model.init_cache(2, 8), cache_index=0)
    np.testing.assert_allclose(model.unembed(hidden), logits, atol=1e-6)
    assert bool(layer_cache(cache, 1).valid[:, :5].all()) and not bool(
        layer_cache(cache, 1).valid[:, 5:].any()
    )
    with pytest.raises(ValueError, match="positions_BxT"):
        model(tokens, cache=cache, cache_index=5)


@pytest.mark.parametrize(
    "kind", ["qwen2-tied", "qwen2-untied", "llama", "qwen3-tied", "gemma3-tied"]
)
def test_export_round_trip_loads_in_transformers(checkpoints, kind, tmp_path):
    model = models.from_pretrained(checkpoints[kind][0])
    # Tiny shard limit: forces the sharded layout with model.safetensors.index.json.
    out = models.save_pretrained(model, tmp_path / "out", max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").exists()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(hf_model).__name__ == models.ARCHITECTURES[model.config.architecture]
    tokens = _tokens((2, 7), seed=4)
    np.testing.assert_allclose(
        _hf_logits(hf_model, tokens), np.asarray(model(jnp.asarray(tokens))), atol=TOL, rtol=0
    )
    again = models.from_pretrained(out)
    assert again.config == model.config
    single = models.save_pretrained(again, tmp_path / "single")
    assert (single / "model.safetensors").exists()
    assert not (single / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("kind", ["qwen2-untied", "llama", "qwen3-untied", "gemma3-tied"])
def test_bf16_compute_logits_against_fp32_and_transformers_bf16(checkpoints, kind):
    """fp32 masters computing in bf16: logits stay fp32 and within bf16 rounding of both our
    fp32 logits and transformers' own bf16 forward. Tolerance 3% of the largest logit; measured
    on the CPU (2026-11-29, the same with the dense, blocked and xla kernels) 1.0-2.7% against
    our fp32 and 0.8-1.5% against transformers' bf16 (random weights of scale 0.15, logits up to
    ~2.9)."""
    path, hf_model = checkpoints[kind]
    model = models.from_pretrained(path)
    model16 = models.with_compute_dtype(model, "bfloat16")
    assert model16.embedding.get_value().dtype == jnp.float32  # the masters stay fp32
    tokens = _tokens((2, 9), seed=7)
    ours32 = np.asarray(model(jnp.asarray(tokens)))
    ours16 = np.asarray(jax.jit(lambda m, x: m(x))(model16, jnp.asarray(tokens)))
    assert ours16.dtype == np.float32
    hf16 = copy.deepcopy(hf_model).to(torch.bfloat16)  # the fixture's fp32 model stays intact
    ref16 = _hf_logits(hf16, tokens).astype(np.float32)
    scale = np.abs(ours32).max()
    assert np.abs(ours16 - ours32).max() < 0.03 * scale
    assert np.abs(ours16 - ref16).max() < 0.03 * scale
    # Computed in bf16, not in fp32: every matmul of the forward (and of its gradient) takes
    # bf16 operands; only the masters are fp32. Checked for each attention kernel (the one
    # `auto` picks differs by platform: GPU runs `xla`). `xla` is jax.nn.dot_product_attention,
    # whose scores come out of their product in fp32: their fp32 cotangent meets the bf16 keys
    # and queries in two products per layer, which XLA runs in fp32; nothing else may.
    x = jnp.asarray(tokens)
    for kernel in ("dense", "blocked", "xla"):
        m = models.with_config(model16, attention=kernel)
        forward = jax.make_jaxpr(lambda m, x: m(x))(m, x)
        assert _matmul_operands(forward.jaxpr) and not _fp32_matmuls(forward.jaxpr), kernel
        grad = jax.make_jaxpr(nnx.grad(lambda m, x: models.token_logprobs(m, x).sum()))(m, x)
        fp32 = _fp32_matmuls(grad.jaxpr)
        if kernel != "xla":
            assert not fp32, (kernel, fp32)
            continue
        t = tokens.shape[1]
        assert len(fp32) == 2 * m.config.num_layers, fp32
        for operands in fp32:  # one fp32 operand each: the scores' cotangent, [.., T, .., S]
            (scores,) = [o for o in operands if o.dtype == jnp.float32]
            assert scores.shape[-1] == t and t in scores.shape[:-1], operands


def _matmul_operands(jaxpr) -> list:
    """The operands' avals of every dot_general in a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(v.aval for v in eqn.invars))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _matmul_operands(inner)
    return found


def _fp32_matmuls(jaxpr) -> list:
    """The dot_generals (their operands' avals) of which an operand is not bf16."""
    return [o for o in _matmul_operands(jaxpr) if any(a.dtype != jnp.bfloat16 for a in o)]


def test_bfloat16_load_and_export(checkpoints, tmp_path):
    path, hf_model = checkpoints["qwen2-untied"]
    model = models.from_pretrained(path, "bfloat16", "bfloat16")
    assert model.embedding.get_value().dtype == jnp.bfloat16
    tokens = _tokens((2, 7), seed=5)
    logits = np.asarray(model(jnp.asarray(tokens)))
    assert logits.dtype == np.float32
    ref = _hf_logits(hf_model, tokens)
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max()  # bf16 rounding, same model
    out = models.save_pretrained(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = models.from_pretrained(out, "bfloat16")
    np.testing.assert_array_equal(
        np.asarray(back.lm_head.get_value(), np.float32),
        np.asarray(model.lm_head.get_value(), np.float32),
    )
    # fp32 masters exported in bf16 (train.export_dtype): transformers loads the bf16 tensors.
    masters = models.from_pretrained(path)
    out16 = models.save_pretrained(masters, tmp_path / "masters_bf16", dtype="bfloat16")
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(out16, attn_implementation="eager")
    assert hf16.dtype == torch.bfloat16 and hf16.lm_head.weight.dtype == torch.bfloat16
    np.testing.assert_array_equal(
        hf16.lm_head.weight.detach().float().numpy(),
        np.asarray(masters.lm_head.get_value().astype(jnp.bfloat16), np.float32),
    )
    got = _hf_logits(hf16, tokens)
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_rope_theta_read_from_both_config_layouts(checkpoints, tmp_path):
    src = checkpoints["qwen2-untied"][0]
    hf = json.loads((src / "config.json").read_text())
    assert hf["rope_parameters"]["rope_theta"] == 5000.0
    assert models.from_pretrained(src).config.rope_theta == 5000.0
    old = tmp_path / "old_layout"
    shutil.copytree(src, old)
    hf.pop("rope_parameters")
    hf["rope_theta"] = 5000.0  # transformers 4.x layout
    (old / "config.json").write_text(json.dumps(hf))
    assert models.from_pretrained(old).config.rope_theta == 5000.0


def _broken_copy(src, dst, edit=None, drop=None, reshape=None):
    shutil.copytree(src, dst)
    if edit is not None:
        hf = json.loads((dst / "config.json").read_text())
        edit(hf)
        (dst / "config.json").write_text(json.dumps(hf))
    if drop is not None or reshape is not None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(dst / "model.safetensors")
        if drop is not None:
            tensors.pop(drop)
        if reshape is not None:
            tensors[reshape] = tensors[reshape][:-1]
        save_file(tensors, dst / "model.safetensors")
    return dst


def test_bad_checkpoints_give_one_clear_error(checkpoints, tmp_path):
    src = checkpoints["qwen2-untied"][0]
    with pytest.raises(models.CheckpointError, match="config.json not found"):
        models.from_pretrained(tmp_path / "nowhere")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(src / "config.json", no_weights)
    with pytest.raises(models.CheckpointError, match="model.safetensors"):
        models.from_pretrained(no_weights)
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(models.CheckpointError, match=f"missing tensor '{name}'"):
        models.from_pretrained(_broken_copy(src, tmp_path / "missing", drop=name))
    with pytest.raises(models.CheckpointError, match=f"tensor '{name}' has shape \\(63, 32\\)"):
        models.from_pretrained(_broken_copy(src, tmp_path / "shape", reshape=name))
    one_layer = lambda hf: hf.update(num_hidden_layers=1)
    with pytest.raises(models.CheckpointError, match="unexpected tensor 'model.layers.1"):
        models.from_pretrained(_broken_copy(src, tmp_path / "extra", edit=one_layer))
    gpt2 = lambda hf: hf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(models.CheckpointError, match="model_type='gpt2'"):
        models.from_pretrained(_broken_copy(src, tmp_path / "arch", edit=gpt2))
    sharded = models.save_pretrained(
        models.from_pretrained(src), tmp_path / "sharded", max_shard_bytes=20_000
    )
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(models.CheckpointError, match=f"lists '{shard.name}', which is missing"):
        models.from_pretrained(sharded)
    assert issubclass(models.CheckpointError, ValueError)


def test_qwen25_math_7b_preset_has_published_parameter_count():
    cfg = models.PRESETS["qwen2.5-math-7b"]
    model = models.abstract_model(cfg)  # jax.eval_shape: no memory
    assert model.num_params() == 7_615_616_512  # Qwen2.5-Math-7B safetensors total (7.62B)
    assert models.abstract_model(models.PRESETS["qwen2.5-0.5b"]).num_params() == 494_032_768
    assert models.abstract_model(models.PRESETS["smollm2-135m"]).num_params() == 134_515_008
    assert models.param_count(models.abstract_model(models.PRESETS["bench-45m"])) == 39_336_448
    logits = jax.eval_shape(
        lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32))
    )
    assert logits.shape == (1, 4, 152064) and logits.dtype == jnp.float32


# Published Qwen3 dense shapes (Qwen/Qwen3-*/config.json): D, layers, heads, MLP, tied, total.
QWEN3_PUBLISHED = {
    "qwen3-0.6b": (1024, 28, 16, 3072, True, 596_049_920),
    "qwen3-1.7b": (2048, 28, 16, 6144, True, 1_720_574_976),
    "qwen3-4b": (2560, 36, 32, 9728, True, 4_022_468_096),
    "qwen3-8b": (4096, 36, 32, 12288, False, 8_190_735_360),
}


@pytest.mark.parametrize("name", sorted(QWEN3_PUBLISHED))
def test_qwen3_presets_have_published_shapes_and_transformers_parameter_counts(name):
    """jax.eval_shape count == transformers' Qwen3ForCausalLM on the meta device (no memory) ==
    the total from the published shapes: per layer D*(N+2K)*H + N*H*D (attention) + 2H
    (QK-norm) + 3*D*F (MLP) + 2D (norms), plus V*D (embedding, once if tied) and D."""
    hidden, layers, heads, inter, tied, total = QWEN3_PUBLISHED[name]
    cfg = models.PRESETS[name]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size) == (
        hidden, layers, heads, inter
    )  # fmt: skip
    assert (cfg.vocab_size, cfg.num_kv_heads, cfg.head_dim) == (151936, 8, 128)
    assert cfg.tie_word_embeddings == tied and cfg.qk_norm and not cfg.attention_bias
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e6, 1e-6, 40960)
    n, k, h, d, f, v = heads, 8, 128, hidden, inter, 151936
    per_layer = d * (n + 2 * k) * h + n * h * d + 2 * h + 3 * d * f + 2 * d
    assert layers * per_layer + v * d * (1 if tied else 2) + d == total
    hf_cfg = transformers.Qwen3Config(
        vocab_size=v,
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=n,
        num_key_value_heads=k,
        head_dim=h,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        hf_model = transformers.Qwen3ForCausalLM(hf_cfg)
    assert sum(p.numel() for p in hf_model.parameters()) == total  # tied: counted once
    assert models.abstract_model(cfg).num_params() == total


@pytest.mark.parametrize("kind", ["qwen3-untied", "gemma3-tied"])
def test_blocked_attention_beyond_one_block_matches_transformers(checkpoints, kind):
    """520 tokens (> one 512-key block; 1040 query rows, 2 query heads per KV head, > one
    512-row block) through the blocked kernel, one row left-padded: transformers' logits
    (gemma3: two sliding-window layers; the skipping of whole key blocks is tested on small
    blocks in test_attention.py)."""
    path, hf_model = checkpoints[kind]
    model = models.with_config(models.from_pretrained(path), attention="blocked")
    t = models.attention.BLOCK_K + 8
    tokens = _tokens((2, t), seed=12)
    mask = np.ones((2, t), np.int32)
    mask[1, :100] = 0
    ours = np.asarray(jax.jit(lambda m, x, k: m(x, mask_BxT=k))(model, tokens, mask))
    ref = _hf_logits(hf_model, tokens, mask, np.maximum(np.cumsum(mask, 1) - 1, 0))
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3-tied", "gemma3-tied"])
@pytest.mark.parametrize("num_slots", [0, 2], ids=["static", "continuous"])
def test_greedy_generation_matches_transformers_generate(checkpoints, num_slots, kind):
    """The sampler (prefill, shared-prefix decode cache; or 2 continuous-batching slots for 4
    rows) decodes greedily to transformers' `generate` tokens (gemma3: 10 tokens past prompts
    of 1-8, well past its window of 4)."""
    path, hf_model = checkpoints[kind]
    model = models.from_pretrained(path)
    prompts, n = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13], [60], [3, 4, 4, 4, 60, 61, 1, 2]], 10
    ids, lens = sampler.pad_prompts(prompts, (16,))
    settings = sampler.SamplingSettings(max_new_tokens=n, temperature=0.0, num_slots=num_slots)
    out = sampler.generate(model, ids, lens, settings, rng=jax.random.key(0))
    for row, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out.tokens_BxN[row]), ref[0, len(prompt) :])


def test_qwen3_checkpoint_and_config_errors(checkpoints, tmp_path):
    src = checkpoints["qwen3-tied"][0]
    biased = lambda hf: hf.update(attention_bias=True)
    with pytest.raises(models.CheckpointError, match="attention_bias=true is not supported"):
        models.from_pretrained(_broken_copy(src, tmp_path / "bias", edit=biased))
    sliding = lambda hf: hf.update(layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(models.CheckpointError, match="'sliding_attention'"):
        models.from_pretrained(_broken_copy(src, tmp_path / "sliding", edit=sliding))
    name = "model.layers.1.self_attn.k_norm.weight"
    with pytest.raises(models.CheckpointError, match=f"missing tensor '{name}'"):
        models.from_pretrained(_broken_copy(src, tmp_path / "no_norm", drop=name))
    with pytest.raises(ValueError, match="needs qk_norm=True and attention_bias=False"):
        models.PRESETS["tiny"].replace(architecture="qwen3")
    llama_qk = models.PRESETS["tiny"].replace(architecture="llama", attention_bias=False)
    with pytest.raises(models.CheckpointError, match="use architecture='qwen3'"):
        models.config_to_hf(llama_qk.replace(qk_norm=True))
    # transformers' Llama with attention_bias biases o_proj too, which this model has not: a
    # checkpoint with it is refused, and so is exporting one (it would load with a random bias).
    with pytest.raises(models.CheckpointError, match="use architecture='qwen2'"):
        models.config_to_hf(llama_qk.replace(attention_bias=True))
    with pytest.raises(models.CheckpointError, match="not supported for llama"):
        models.from_pretrained(_broken_copy(checkpoints["llama"][0], tmp_path / "llama_bias",
                                            edit=biased))  # fmt: skip


TINY_QWEN3 = models.PRESETS["tiny"].replace(
    architecture="qwen3", qk_norm=True, attention_bias=False
)


TINY_GEMMA3 = models.PRESETS["tiny"].replace(
    architecture="gemma3", qk_norm=True, attention_bias=False, layer_types=("sliding", "full"),
    sliding_window=3, query_pre_attn_scalar=24,
)  # fmt: skip


@pytest.mark.parametrize(
    "cfg", [models.PRESETS["tiny"], TINY_QWEN3, TINY_GEMMA3], ids=["qwen2", "qwen3", "gemma3"]
)
def test_remat_gives_same_gradients(cfg):
    tokens = jnp.asarray(_tokens((2, 6), vocab=cfg.vocab_size, seed=6))

    def grads(remat):
        model = models.Transformer(cfg.replace(remat=remat), rngs=nnx.Rngs(7))
        loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])
        return nnx.jit(nnx.grad(loss))(model)

    g0, g1 = grads(False), grads(True)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_remat_gives_same_gradients_through_a_shared_prefix():
    # The update's path: the prefix fills a KV cache (int / bool leaves too) that the new tokens
    # read, both under remat.
    cfg = models.PRESETS["tiny"]
    tokens = jnp.asarray(_tokens((4, 9), vocab=cfg.vocab_size, seed=8))
    tokens = tokens.at[1].set(tokens[0]).at[3, :4].set(tokens[2, :4])
    tokens = tokens.at[1, 5:].set(_tokens((1, 4), vocab=cfg.vocab_size, seed=9)[0])
    mask = jnp.ones((4, 9), jnp.float32).at[:2, 0].set(0).at[2:, 8].set(0)

    def grads(remat):
        model = models.Transformer(cfg.replace(remat=remat), rngs=nnx.Rngs(3))

        def loss(m):
            h = m.hidden_shared_prefix(tokens, mask, prefix_len=4, group_size=2)
            return jnp.mean(jax.nn.log_softmax(m.unembed(h))[..., 5])

        return nnx.jit(nnx.grad(loss))(model)

    g0, g1 = grads(False), grads(True)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_remat_keeps_one_layer_of_activations_live():
    # Compiled memory of a forward + backward: with remat each extra layer may add its saved
    # input [B, T, D] (and slack for one more), not its recomputed activations. A remat whose
    # recomputation XLA is free to schedule early (nnx.remat on CPU) grows by a whole layer's
    # attention scores and MLP activations per layer, as if there were no remat.
    b, t = 4, 256

    def temp_bytes(layers, remat):
        cfg = models.PRESETS["tiny"].replace(num_layers=layers, remat=remat)
        graphdef, params = nnx.split(models.abstract_model(cfg), nnx.Param)

        def loss(p, tokens):
            return jnp.mean(nnx.merge(graphdef, p).hidden(tokens) ** 2)

        tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
        compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    saved_input = b * t * models.PRESETS["tiny"].hidden_size * 4
    per_layer = (temp_bytes(6, True) - temp_bytes(2, True)) / 4
    per_layer_without = (temp_bytes(6, False) - temp_bytes(2, False)) / 4
    assert per_layer <= 2 * saved_input, (per_layer, saved_input)
    assert per_layer_without > 10 * saved_input  # the test's shapes make remat matter


def test_logical_axis_names_map_onto_a_mesh():
    cfg = models.PRESETS["tiny"]
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    # nnx passes unmapped names through, so rules name every axis (None = replicated).
    rules = (("vocab", "tensor"), ("mlp", "tensor"), ("heads", "tensor"), ("embed", "fsdp"))
    rules += (("kv_heads", None), ("head_dim", None), ("norm", None), ("layers", None))
    rules += (("expert", None), ("expert_mlp", "tensor"), ("router", None))
    assert {r[0] for r in rules} == set(models.PARAM_AXES)
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    P = jax.sharding.PartitionSpec
    assert specs["embedding"].get_value() == P("tensor", "fsdp")
    assert specs["layers"][0]["attn"]["q_kernel"].get_value() == P("fsdp", "tensor", None)
    assert specs["layers"][0]["mlp"]["down_kernel"].get_value() == P("tensor", "fsdp")
    assert specs["final_norm"]["scale"].get_value() == P(None)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tokens = jnp.asarray(_tokens((4, 8), vocab=cfg.vocab_size, seed=8))
    expected = np.asarray(model(tokens))
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh), nnx.logical_axis_rules((*rules, ("batch", "fsdp"))):
        shardings = nnx.get_named_sharding(state, mesh)
        state = jax.device_put(state, shardings)
        out = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    assert state["embedding"].get_value().sharding.spec == P("tensor", "fsdp")
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def _naive_token_logprobs(model, tokens, mask):
    logp_BxTxV = jax.nn.log_softmax(model(tokens, mask_BxT=mask), axis=-1)
    logp = jnp.take_along_axis(logp_BxTxV[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    real = mask.astype(bool)
    return jnp.pad(jnp.where(real[:, 1:] & real[:, :-1], logp, 0.0), ((0, 0), (1, 0)))


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_token_logprobs_equal_naive_values_and_gradients(tied, monkeypatch):
    monkeypatch.setattr(models.logprobs, "_MIN_BLOCK", 1)  # small blocks and a tail block
    cfg = models.PRESETS["tiny"].replace(tie_word_embeddings=tied)
    model = models.Transformer(cfg, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(_tokens((3, 10), vocab=cfg.vocab_size, seed=9))
    mask = jnp.asarray((np.arange(10)[None] < np.array([[10], [7], [2]])).astype(np.int32))
    # float64 numpy reference from the model's logits.
    logits = np.asarray(model(tokens, mask_BxT=mask), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ref = np.zeros((3, 10))
    for b in range(3):
        for t in range(1, 10):
            if mask[b, t] and mask[b, t - 1]:
                ref[b, t] = logits[b, t - 1, tokens[b, t]] - lse[b, t - 1]
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(3, 10)), jnp.float32)

    def value_and_grads(logprob_fn):
        loss = lambda m: (jnp.sum(weights * logprob_fn(m)), logprob_fn(m))
        return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)

    (_, naive), naive_grads = value_and_grads(lambda m: _naive_token_logprobs(m, tokens, mask))
    np.testing.assert_allclose(np.asarray(naive), ref, atol=1e-5)
    for chunk in (4, 64):  # 4: blocks of 37 rows + a tail of 34; 64: one block
        fn = lambda m, chunk=chunk: models.token_logprobs(m, tokens, mask, chunk_size=chunk)
        (_, logp), grads = value_and_grads(fn)
        assert logp.shape == (3, 10) and logp.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(logp), ref, atol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(naive_grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_chunked_logprobs_never_hold_full_logits():
    """XLA's memory analysis: the chunked gradient's temporaries stay below one [B,T,V] buffer."""
    b, t, d, v = 4, 256, 32, 32768
    args = (
        jax.ShapeDtypeStruct((b, t, d), jnp.float32),
        jax.ShapeDtypeStruct((v, d), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
    )

    def temp_bytes(fn):
        loss = lambda h, w, y: jnp.sum(fn(h, w, y))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    full_logits = b * t * v * 4
    chunked = temp_bytes(lambda h, w, y: models.chunked_logprobs(h, w, y, chunk_size=16))
    assert temp_bytes(models.naive_logprobs) > 2 * full_logits
    assert chunked < 0.5 * full_logits


def _grad_temp_bytes(fn, b, t, d, v, dtype=jnp.float32, **kw):
    args = (
        jax.ShapeDtypeStruct((b, t, d), dtype),
        jax.ShapeDtypeStruct((v, d), dtype),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
    )
    loss = lambda h, w, y: jnp.sum(fn(h, w, y, **kw))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_logprobs_memory_does_not_grow_with_the_batch(monkeypatch):
    """Blocks hold chunk_size * V logits for all B*T tokens together: 4x the batch, same peak."""
    monkeypatch.setattr(models.logprobs, "_MIN_BLOCK", 1)
    kw = dict(chunk_size=16)
    small = _grad_temp_bytes(models.chunked_logprobs, 2, 256, 16, 32768, **kw)
    large = _grad_temp_bytes(models.chunked_logprobs, 8, 256, 16, 32768, **kw)
    block_logits = 16 * 32768 * 4
    assert large < 1.25 * small and large < 8 * block_logits


def test_chunked_logprobs_bf16_gradient_has_no_fp32_vocab_matrix():
    """No fp32 [V, D] buffer (accumulator or widened copy) for a bf16 unembedding."""
    b, t, d, v = 2, 64, 256, 32768
    temp = _grad_temp_bytes(models.chunked_logprobs, b, t, d, v, jnp.bfloat16, chunk_size=4)
    assert temp < 0.75 * v * d * 4


def test_chunked_logprobs_bf16_match_naive(monkeypatch):
    monkeypatch.setattr(models.logprobs, "_MIN_BLOCK", 1)
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(300, 16)) * 0.3, jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, 300, (2, 5)), jnp.int32)
    g = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
    loss = lambda fn: lambda h, w: jnp.sum(g * fn(h, w, y))
    chunked = functools.partial(models.chunked_logprobs, chunk_size=3)  # 6 blocks of 90 + tail
    (va, ga) = jax.value_and_grad(loss(models.naive_logprobs), argnums=(0, 1))(h, w)
    (vb, gb) = jax.value_and_grad(loss(chunked), argnums=(0, 1))(h, w)
    np.testing.assert_allclose(float(va), float(vb), rtol=1e-5)
    for a, b in zip(ga, gb, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["qwen2-untied", "qwen3-untied"])
def test_from_pretrained_places_each_tensor_with_given_shardings(checkpoints, kind):
    path = checkpoints[kind][0]
    cfg = models.from_pretrained(path).config
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (("vocab", "tensor"), ("mlp", "tensor"), ("heads", "tensor"), ("embed", "fsdp"))
    rules += (("kv_heads", None), ("head_dim", None), ("norm", None), ("layers", None))
    rules += (("expert", None), ("expert_mlp", "tensor"), ("router", None))
    with nnx.logical_axis_rules(rules):
        abstract = nnx.state(models.abstract_model(cfg), nnx.Param)
        shardings = nnx.get_named_sharding(abstract, mesh)
    model = models.from_pretrained(path, shardings=shardings)
    P = jax.sharding.PartitionSpec
    assert model.lm_head.get_value().sharding.spec == P("tensor", "fsdp")
    up = model.layers[1].mlp.up_kernel.get_value()
    assert up.sharding.spec == P("fsdp", "tensor") and len(up.addressable_shards) == 8
    if cfg.qk_norm:  # the QK-norm scales are `norm` parameters: replicated
        assert model.layers[1].attn.k_norm.scale.get_value().sharding.spec == P(None)
    tokens = _tokens((2, 5), seed=10)
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(tokens))),
        _hf_logits(checkpoints[kind][1], tokens),
        atol=TOL,
        rtol=0,
    )


@pytest.mark.parametrize(
    "name,published",
    [("gemma3-270m", 268_098_176), ("gemma3-1b", 999_885_952), ("gemma3-4b", None)],
)
def test_gemma3_presets_have_published_shapes_and_transformers_parameter_counts(name, published):
    """Our eval_shape count = transformers' Gemma3ForCausalLM built (on the meta device) from the
    config we export = the published total (270M: the GGUF's tensors; 1B: its model card)."""
    cfg = models.PRESETS[name]
    assert cfg.layer_types.count("full") == cfg.num_layers // 6 and cfg.head_dim == 256
    hf = models.config_to_hf(cfg)
    hf_cfg = transformers.Gemma3TextConfig(
        **{k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    )
    assert hf_cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    with torch.device("meta"):
        hf_model = transformers.Gemma3ForCausalLM(hf_cfg)
    total = models.abstract_model(cfg).num_params()
    assert sum(p.numel() for p in hf_model.parameters()) == total
    if published is not None:
        assert total == published
    assert models.config_from_hf(hf) == cfg.replace(param_dtype="float32")


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported for Gemma 3"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"layer_types": ["sliding_attention"]}, "layer_types .* per layer for 18 layers"),
        ({"sliding_window": None}, "sliding layers but sliding_window is 0"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}},
            "rope type 'yarn' of full_attention layers is not supported",
        ),
    ],
)
def test_gemma3_config_errors_name_the_field(edit, message):
    hf = {**models.config_to_hf(models.PRESETS["gemma3-270m"]), **edit}
    with pytest.raises(models.CheckpointError, match=message):
        models.config_from_hf(hf, source="g/config.json")
