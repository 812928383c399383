"""Layers under one scan (`ModelConfig.scan_layers`): the same model as the unrolled one (values,
gradients, samples), the same files in and out, and programs whose size does not grow with
depth."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from gvpo_jax import models, resume, sampler
from gvpo_jax.models import lora
from gvpo_jax.models.transformer import layer_kind

TINY = models.PRESETS["tiny"]
FAMILIES = {
    "qwen2": TINY,
    "qwen3": TINY.replace(architecture="qwen3", qk_norm=True, attention_bias=False),
    "llama": TINY.replace(architecture="llama", attention_bias=False, tie_word_embeddings=False),
    # Both of Gemma 3's layer kinds, a run of sliding layers and one after the full layer: what
    # its 5 + 1 pattern gives the scan's switch, at half the depth (compile time)
    "gemma3": TINY.replace(
        architecture="gemma3", qk_norm=True, attention_bias=False, num_layers=4,
        layer_types=("sliding", "sliding", "full", "sliding"), sliding_window=4,
        query_pre_attn_scalar=16,
    ),
}  # fmt: skip


def _pair(cfg, seed=0):
    unrolled = models.Transformer(cfg.replace(scan_layers=False), rngs=nnx.Rngs(seed))
    return unrolled, models.Transformer(cfg.replace(scan_layers=True), rngs=nnx.Rngs(seed))


def _stacked(unrolled_state):
    """An unrolled model's parameters in the scanned layout (layers stacked [L, ...])."""
    flat = dict(nnx.to_flat_state(unrolled_state))
    out, layers = {}, {}
    for path, v in flat.items():
        if path[0] == "layers":
            layers.setdefault(("layers", *path[2:]), []).append((path[1], v.get_value()))
        else:
            out[path] = v.get_value()
    for path, items in layers.items():
        out[path] = np.stack([np.asarray(x) for _, x in sorted(items)])
    return out


def _values(state) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(1, vocab, (4, 12)), jnp.int32)
    mask = jnp.asarray(np.arange(12)[None] >= np.array([0, 2, 0, 3])[:, None])
    return tokens, mask


def test_layer_kinds_are_one_for_uniform_layers_and_two_for_gemma3():
    kinds = lambda cfg: {layer_kind(cfg, i) for i in range(cfg.num_layers)}
    assert len(kinds(TINY)) == 1
    assert len(kinds(FAMILIES["gemma3"])) == 2  # sliding (window 4, base 1e4), full
    assert len(kinds(models.PRESETS["gemma3-1b"])) == 2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scanned_equals_unrolled_values_gradients_and_samples(family):
    """Same seed, same parameters (stacked); logits and the shared-prefix forward to fp32
    rounding, the log-prob gradient to 1e-6 of its largest entry, and (Qwen2 and Gemma 3, whose
    sliding layers take the scan's other branch) identical greedy and sampled tokens from the
    static, continuous and shedding decodes."""
    cfg = FAMILIES[family]
    unrolled, scanned = _pair(cfg)
    want, got = _stacked(nnx.state(unrolled, nnx.Param)), _values(nnx.state(scanned, nnx.Param))
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
    tokens, mask = _batch(cfg.vocab_size)
    logits = jax.jit(lambda m: m(tokens, None, mask))
    np.testing.assert_allclose(logits(scanned), logits(unrolled), atol=2e-5)
    shared = jax.jit(
        lambda m: m.hidden_shared_prefix(tokens, mask * 0 + 1, prefix_len=5, group_size=2)
    )
    np.testing.assert_allclose(shared(scanned), shared(unrolled), atol=2e-5)
    grad = jax.jit(nnx.grad(lambda m: models.token_logprobs(m, tokens, mask).sum()))
    g_want, g_got = _stacked(grad(unrolled)), _values(grad(scanned))
    scale = max(np.abs(x).max() for x in g_want.values())
    for path in g_want:
        np.testing.assert_allclose(g_got[path], g_want[path], atol=1e-6 * scale, err_msg=str(path))
    prompts, lens = tokens[:2, :6], jnp.asarray([6, 4], jnp.int32)
    if family in ("qwen3", "llama"):  # their caches and decode loops are qwen2's
        return
    # greedy in the static batch, sampled with continuous batching and with a shedding decode
    # (Gemma 3: the static batch and the shedding one; continuous batching over its sliding
    # windows is checked against transformers' generate in tests/test_models.py)
    modes = ((0.0, {}), (1.0, dict(num_slots=3)), (1.0, dict(shed=1)))
    for temperature, kw in modes if family == "qwen2" else (modes[0], modes[2]):
        settings = sampler.SamplingSettings(
            max_new_tokens=7, group_size=2, eos_ids=(3,), temperature=temperature, **kw
        )
        a, b = (sampler.generate(m, prompts, lens, settings, rng=jax.random.key(1))
                for m in (unrolled, scanned))  # fmt: skip
        np.testing.assert_array_equal(a.tokens_BxN, b.tokens_BxN, err_msg=str(kw))
        np.testing.assert_allclose(a.logp_BxN, b.logp_BxN, atol=2e-5)
    if family != "qwen2":
        return
    # scan_decode=False: the sampler slices the stacked blocks once and runs them unrolled
    sliced = models.with_config(scanned, scan_decode=False)
    c = sampler.generate(sliced, prompts, lens, settings, rng=jax.random.key(1))
    np.testing.assert_array_equal(c.tokens_BxN, a.tokens_BxN)
    np.testing.assert_allclose(c.logp_BxN, a.logp_BxN, atol=2e-5)


def test_lora_on_scanned_layers_equals_lora_on_unrolled_layers(tmp_path):
    """Adapters drawn alike (layer by layer), stacked like the kernels: the same adapted logits,
    the same merged kernels, byte-identical PEFT files."""
    spec = lora.LoRASpec(rank=2, alpha=4.0, targets=("q_proj", "o_proj", "down_proj"))
    models_ = [lora.attach(m, spec, seed=3) for m in _pair(TINY)]
    for m in models_:  # B = 0 gives the base: move it so the adapters count
        for _, _, adapter in lora.adapters(m):
            adapter.b[...] = 0.1 * jnp.ones_like(adapter.b[...])
    unrolled, scanned = models_
    tokens, mask = _batch(TINY.vocab_size)
    np.testing.assert_allclose(scanned(tokens, None, mask), unrolled(tokens, None, mask), atol=2e-5)
    sliced = models.unstacked(scanned)  # the sampler's unrolled view: adapters sliced too
    assert not sliced.config.scan_layers and len(lora.adapters(sliced)) == len(
        lora.adapters(unrolled)
    )
    np.testing.assert_allclose(sliced(tokens, None, mask), unrolled(tokens, None, mask), atol=2e-5)
    merged = [lora.merged(m) for m in models_]
    want, got = _stacked(nnx.state(merged[0], nnx.Param)), _values(nnx.state(merged[1], nnx.Param))
    for path in want:
        np.testing.assert_allclose(got[path], want[path], atol=1e-6, err_msg=str(path))
    for name, m in zip(("u", "s"), models_, strict=True):
        lora.save_peft(m, tmp_path / name, spec)
    assert (tmp_path / "u/adapter_model.safetensors").read_bytes() == (
        tmp_path / "s/adapter_model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_scanned_layout_exports_and_imports_the_same_files(family, tmp_path):
    """save_pretrained writes the unrolled model's tensors from the stacked one (parameter by
    parameter: the file's order differs), and from_pretrained(scan_layers=True) stacks them back."""
    unrolled, scanned = _pair(FAMILIES[family])
    models.save_pretrained(unrolled, tmp_path / "u")
    models.save_pretrained(scanned, tmp_path / "s")
    assert (tmp_path / "u/config.json").read_bytes() == (tmp_path / "s/config.json").read_bytes()
    want, got = (safetensors.numpy.load_file(tmp_path / d / "model.safetensors") for d in "us")
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    loaded = models.from_pretrained(tmp_path / "u", scan_layers=True)
    assert loaded.config.scan_layers
    want, got = _values(nnx.state(scanned, nnx.Param)), _values(nnx.state(loaded, nnx.Param))
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def _ops(lowered) -> int:
    """Operations in a lowered program's StableHLO text (nested functions included)."""
    return len(re.findall(r"^\s*(?:%\S+ = )?\"?stablehlo\.", lowered.as_text(), re.M))


def _programs(layers: int, scan: bool) -> dict[str, int]:
    cfg = TINY.replace(num_layers=layers, scan_layers=scan)
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    tokens, mask = _batch(cfg.vocab_size)
    update = jax.jit(nnx.grad(lambda m: models.token_logprobs(m, tokens, mask).sum()))
    logprobs = jax.jit(lambda m: models.token_logprobs(m, tokens, mask))
    settings = sampler.SamplingSettings(max_new_tokens=5, group_size=2, eos_ids=(3,))
    decode = jax.jit(lambda m, key: sampler.generate(m, tokens[:2, :6], jnp.asarray([6, 4]),
                                                     settings, rng=key))  # fmt: skip
    return dict(
        update=_ops(update.lower(model)),
        logprobs=_ops(logprobs.lower(model)),
        decode=_ops(decode.lower(model, jax.random.key(0))),
    )


def test_auto_scans_a_model_of_8_layers_or_more_on_cpu_and_every_model_on_an_accelerator():
    """model.scan_layers=auto: on TPU and GPU every model is stacked; on CPU a model of
    CPU_SCAN_MIN_LAYERS (8) layers or more, one layer fewer stays unrolled; true and false force
    it. The trainer's model (a preset with overrides, random weights) follows the rule."""
    from gvpo_jax import assemble, data, sharding
    from gvpo_jax import config as config_lib

    deep = TINY.replace(num_layers=config_lib.CPU_SCAN_MIN_LAYERS)
    shallow = TINY.replace(num_layers=config_lib.CPU_SCAN_MIN_LAYERS - 1)
    c = config_lib.base_config()
    assert config_lib.CPU_SCAN_MIN_LAYERS == 8
    assert config_lib.scan_layers(c, accelerator=False, model=deep)
    assert not config_lib.scan_layers(c, accelerator=False, model=shallow)
    assert config_lib.scan_layers(c, accelerator=True, model=shallow)
    c.model.scan_layers = "false"
    assert not config_lib.scan_layers(c, accelerator=True, model=deep)
    c.model.scan_layers = "true"
    assert config_lib.scan_layers(c, accelerator=False, model=shallow)
    c.model.scan_layers, c.model.preset = "auto", "tiny"
    assert jax.default_backend() == "cpu"
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tok = data.build_char_tokenizer()
    for layers, want in ((7, False), (8, True)):
        c.model.overrides.num_layers = layers
        model, _, _ = assemble.build_model(c, tok, mesh)
        assert model.config.scan_layers is want, layers
        names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))}
        assert ("layers.0.attn.q_kernel" in names) is not want, sorted(names)[:8]


def test_programs_have_the_same_ops_at_2_and_8_layers_when_scanned():
    """The update (log-prob gradient), log-prob and decode programs hold each layer's code
    once: as many operations at 8 layers as at 2. Unrolled, they grow with depth."""
    scanned = {n: _programs(n, True) for n in (2, 8)}
    assert scanned[2] == scanned[8], scanned
    unrolled = {n: _programs(n, False) for n in (2, 8)}
    for name in unrolled[2]:
        assert unrolled[8][name] > 2 * unrolled[2][name] > 0, (name, unrolled)


def test_the_backward_pass_stacks_each_kept_activation_once_and_no_weight():
    """What the layer scan's forward keeps for the backward pass, per layer: a [B*T, D]-sized
    buffer for each of 7 activations (the block's input, the attention norm's output, q, the
    attention's output in two layouts, the sum after attention, the MLP norm's output), gate
    and up [B*T, F] (not the activation: `glu_down` recomputes it), and no copy of a weight.
    The scan stacks and zero-fills each one, so a duplicate (three reshapes of the normed x,
    a norm's normalised x, a reshaped kernel) costs a stacked buffer per program."""
    cfg = FAMILIES["llama"].replace(scan_layers=True)
    graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens, mask = _batch(cfg.vocab_size)
    loss = lambda st: jnp.sum(nnx.merge(graphdef, st).hidden(tokens, None, mask) ** 2)
    forward = next(
        e for e in jax.make_jaxpr(jax.grad(loss))(state).eqns if e.primitive.name == "scan"
    )
    kept = [int(np.prod(v.aval.shape[1:])) for v in forward.outvars[forward.params["num_carry"] :]]
    rows = tokens.size
    assert kept.count(rows * cfg.intermediate_size) == 2
    assert kept.count(rows * cfg.hidden_size) == 7
    weights = {int(np.prod(v.shape[1:])) for v in jax.tree.leaves(state["layers"])}
    assert not weights & set(kept), (weights, kept)


def _kept_for_backward(cfg):
    """The shapes [L, ...] the layer scan's forward keeps for the backward pass, and the
    stacked parameters' shapes."""
    graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens, mask = _batch(cfg.vocab_size)
    loss = lambda st: jnp.sum(nnx.merge(graphdef, st).hidden(tokens, None, mask) ** 2)
    forward = next(
        e for e in jax.make_jaxpr(jax.grad(loss))(state).eqns if e.primitive.name == "scan"
    )
    kept = [v.aval.shape for v in forward.outvars[forward.params["num_carry"] :]]
    return kept, [v.shape for v in jax.tree.leaves(state["layers"])]


def test_gemma3s_two_layer_kinds_keep_no_weight_and_share_their_residuals():
    """Gemma 3's sliding and full layers under one scan: the switch between the kinds wraps
    the rotary embedding and the attention alone, so the backward pass keeps no copy of a
    weight (a switch around the whole layer returned every weight from the switch, stacked),
    and the two kinds share their residuals' buffers: the forward keeps what one kind keeps
    plus the switch's own (the mask, the rotary tables of q and k, the kind index)."""
    gemma = FAMILIES["gemma3"].replace(scan_layers=True)
    assert len(set(gemma.layer_types)) == 2
    two, weights = _kept_for_backward(gemma)
    one, _ = _kept_for_backward(gemma.replace(layer_types=("full",) * gemma.num_layers))
    size = lambda shape: int(np.prod(shape[1:]))
    assert not {size(w) for w in weights} & {size(k) for k in two}, (weights, two)
    assert len(one) == 22 and len(two) <= len(one) + 6, (one, two)
    assert sum(map(size, two)) < 1.2 * sum(map(size, one)), (one, two)


@pytest.mark.parametrize(
    "saved_scanned", [False, True], ids=["unrolled-to-scanned", "scanned-to-unrolled"]
)
def test_a_checkpoint_of_the_other_layout_is_converted_on_restore(saved_scanned):
    """A run resumes a checkpoint written in the other `model.scan_layers` layout: its blocks'
    parameters, Adam moments and frozen reference stacked (or sliced) into the run's layout,
    the values unchanged, the loop state restored."""
    from gvpo_jax import assemble
    from gvpo_jax.rl_step import rl_step
    from tests.test_train import make_run, toy_config

    def config(scan):
        c = toy_config("grpo", **{"model.scan_layers": str(scan).lower()})
        c.model.overrides.num_layers = 2
        return c

    run, state, loop, ref = make_run(config(saved_scanned))
    state, _, _, _ = rl_step(run, state, loop, ref)
    loop.step = 1
    resume.save(run, state, loop, ref)
    run.ckpt.wait()
    assert resume.held_layout(run.workdir + "/checkpoints", 1) is saved_scanned
    other, fresh = assemble.assemble(config(not saved_scanned), run.workdir)
    other_loop = assemble.start_loop(other)
    restored, other_ref, resumed = resume.restore(other, fresh, other_loop)
    assert resumed and other_loop.step == 1 and int(restored.updates) == int(state.updates) == 1

    def by_layer(tree, scanned):  # {path with the layer index: array} of every parameter tree
        out = {}
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            key = jax.tree_util.keystr(path)
            if scanned and "['layers']" in key:
                for i in range(2):
                    out[key.replace("['layers']", f"['layers'][{i}]")] = np.asarray(x[i])
            else:
                out[key] = np.asarray(x)
        return out

    for name, want, got in (("params", state.params, restored.params), ("ref", ref, other_ref),
                            ("moments", state.opt_state, restored.opt_state)):  # fmt: skip
        a, b = by_layer(want, saved_scanned), by_layer(got, not saved_scanned)
        assert a.keys() == b.keys(), name
        assert any("['layers'][1]" in k for k in a), name
        for k in a:
            np.testing.assert_array_equal(b[k], a[k], err_msg=f"{name} {k}")
    assert other.model(restored.params).config.scan_layers is (not saved_scanned)
