"""LoRA policies: exact start, a frozen base outside the optimizer, the reference with adapters
off, merged and PEFT export against transformers / peft, sharded steps, resume, bad input."""

import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gvpo_jax import assemble, models, plan, sharding, train_step
from gvpo_jax import config as config_lib
from gvpo_jax.models import lora, safetensors_io
from gvpo_jax.rl_step import rl_step
from tests import mp_worker
from tests.conftest import child_env
from tests.test_sharding import _rollout_batch
from tests.test_train import make_run, toy_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = models.PRESETS["tiny"].replace(num_layers=1)  # GQA 4/2 heads, biases, tied
SPEC = lora.LoRASpec(rank=4, alpha=8.0)
G, TP = 4, 6  # the sharding tests' rollout batch: 16 prompts x 4, 6 prompt + 6 response slots


def _flat(state) -> dict[tuple, np.ndarray]:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(jax.device_get(state))}


def _lora_model(cfg=CFG, *, random_b: bool = False, seed: int = 0):
    """(base model, the same base with adapters); random_b: B drawn too (a trained policy)."""
    base = models.Transformer(cfg, rngs=nnx.Rngs(seed))
    model = lora.attach(nnx.merge(*nnx.split(base)), SPEC, seed=seed)  # the same base arrays
    if random_b:
        for i, (_, _, adapter) in enumerate(lora.adapters(model)):
            key = jax.random.key(100 + i)
            adapter.b.set_value(0.2 * jax.random.normal(key, adapter.b.shape))
    return base, model


def _logits(model, tokens) -> np.ndarray:
    """The model's logits from one compiled program (not op by op)."""
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


def test_fresh_adapters_give_exactly_the_base_logits():
    base, model = _lora_model()
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, CFG.vocab_size)
    np.testing.assert_array_equal(_logits(model, tokens), _logits(base, tokens))
    assert all(np.all(np.asarray(a.b.get_value()) == 0) for _, _, a in lora.adapters(model))
    assert len(lora.adapters(model)) == 7 * CFG.num_layers  # every projection by default


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_expert_adapters_train_the_experts_and_merge_exactly(scan, tmp_path, capsys):
    """`LoRASpec.experts` (config.lora.experts): per-expert A [E, in, r] / B [E, r, out] on an
    MoE layer's gate / up / down kernels, sharded like the experts. Fresh, the base's logits;
    with B drawn the logits move and equal the merged plain model's, and with the adapters off
    the base's; the gradient reaches every expert A and B and the base stays frozen; the PEFT
    export skips them with a note. Without the option the experts get none."""
    cfg = models.PRESETS["tiny-moe"].replace(scan_layers=scan)
    targets = ("q_proj", "gate_proj", "up_proj", "down_proj")
    base = models.Transformer(cfg, rngs=nnx.Rngs(0))
    copy = lambda: nnx.merge(*nnx.split(base))  # the same base arrays
    plain = lora.attach(copy(), lora.LoRASpec(rank=4, alpha=8.0, targets=targets), seed=0)
    assert [name for _, name, _ in lora.adapters(plain)] == ["q_proj"] * (1 if scan else 2)
    spec = lora.LoRASpec(rank=4, alpha=8.0, targets=targets, experts=True)
    model = lora.attach(copy(), spec, seed=0)
    experts = [(n, a) for _, n, a in lora.adapters(model) if isinstance(a, lora.ExpertAdapter)]
    assert sorted({n for n, _ in experts}) == ["down_proj", "gate_proj", "up_proj"]
    assert len(experts) == 3 * (1 if scan else cfg.num_layers)
    e, d, f, lead = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, scan * ("layers",)
    for name, adapter in experts:
        d_in, d_out, ax_in, ax_out = (
            (f, d, "expert_mlp", "embed") if name == "down_proj" else (d, f, "embed", "expert_mlp")
        )
        assert adapter.a.shape[scan:] == (e, d_in, 4) and adapter.b.shape[scan:] == (e, 4, d_out)
        assert adapter.a.get_metadata()["out_sharding"] == (*lead, "expert", ax_in, None)
        assert adapter.b.get_metadata()["out_sharding"] == (*lead, "expert", None, ax_out)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    want = _logits(base, tokens)
    np.testing.assert_array_equal(_logits(model, tokens), want)
    for i, (_, adapter) in enumerate(experts):  # only the experts' B: their delta alone moves
        adapter.b.set_value(0.2 * jax.random.normal(jax.random.key(10 + i), adapter.b.shape))
    got = _logits(model, tokens)
    assert np.abs(got - want).max() > 1e-2
    np.testing.assert_allclose(_logits(lora.merged(model), tokens), got, atol=1e-5, rtol=1e-5)
    graphdef, params = nnx.split(model, nnx.Param)
    off = nnx.merge(lora.with_adapters(graphdef, params, False), params)
    np.testing.assert_array_equal(_logits(off, tokens), want)
    trained, frozen = lora.split_trainable(params)
    paths = lambda state: [p for p, _ in nnx.to_flat_state(state)]
    assert all(any("_lora" in str(x) for x in p) for p in paths(trained))
    assert not any(any("_lora" in str(x) for x in p) for p in paths(frozen))
    assert any(p[-1] == "gate_kernel" for p in paths(frozen))

    def loss(trained_):
        logits = nnx.merge(graphdef, lora.join(trained_, frozen))(tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = _flat(jax.jit(jax.grad(loss))(trained))
    for path, g in grads.items():
        if path[-2] in ("gate_lora", "up_lora", "down_lora"):
            assert np.abs(g).max() > 0, path
    assert sum(p[-2] in ("gate_lora", "up_lora", "down_lora") for p in grads) == 2 * len(experts)
    lora.save_peft(model, tmp_path, spec)
    note = capsys.readouterr().out
    assert note.count("PEFT export") == 1 and "MoE experts (gate_proj, up_proj, down_proj)" in note
    header = safetensors_io.SafetensorsFile(tmp_path / "adapter_model.safetensors").keys()
    assert header and all(".self_attn.q_proj." in k for k in header)


def test_reference_logprobs_with_adapters_off_equal_the_base_model():
    """The jitted log-prob pass with reference=True runs the same parameters without the adapter
    branch: equal to the base model's, while the adapted policy's differ."""
    base, model = _lora_model(random_b=True)
    batch = _rollout_batch(CFG.vocab_size)
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    rules = sharding.logical_rules(one, CFG)
    graphdef, params = nnx.split(model, nnx.Param)
    off = lora.with_adapters(graphdef, params, False)
    shardings = sharding.param_shardings(params, one, rules)
    kw = dict(prompt_len=TP, chunk_size=4, mesh=one, rules=rules)
    logprobs = train_step.jit_logprobs(graphdef, param_shardings=shardings, reference_graphdef=off,
                                       **kw)  # fmt: skip
    base_gd, base_params = nnx.split(base, nnx.Param)
    base_logprobs = train_step.jit_logprobs(
        base_gd, param_shardings=sharding.param_shardings(base_params, one, rules), **kw
    )
    want = np.asarray(base_logprobs(base_params, batch["tokens"], batch["attn_mask"]))
    ref = np.asarray(logprobs(params, batch["tokens"], batch["attn_mask"], True))
    policy = np.asarray(logprobs(params, batch["tokens"], batch["attn_mask"]))
    np.testing.assert_array_equal(ref, want)
    assert np.abs(policy - want).max() > 1e-3  # the adapters are on in the policy's pass


def test_an_update_changes_only_the_adapters_and_leaves_the_base_bytes_identical():
    """The optimizer holds moments of the adapters alone; after an update the base is
    bit-identical (same bytes) and every adapter moved."""
    _, model = _lora_model()
    graphdef, params = nnx.split(model, nnx.Param)
    tx, loss_fn = mp_worker.gvpo_pieces(graphdef, group_size=G, prompt_len=TP)
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    rules = sharding.logical_rules(one, CFG)
    before = _flat(params)
    state, shardings = train_step.init_state_sharded(params, tx, jnp.zeros(2, jnp.uint32), one,
                                                     rules)  # fmt: skip
    adapters = lora.split_trainable(params)[0]
    moments = jax.tree.leaves(state.opt_state)
    shapes = sorted(x.shape for x in jax.tree.leaves(adapters))
    assert sorted(x.shape for x in moments if x.ndim) == shapes  # SGD momentum: one per adapter
    update = train_step.jit_update(loss_fn, tx, 2, mesh=one, state_shardings=shardings,
                                   rules=rules)  # fmt: skip
    new, metrics = update(state, _rollout_batch(CFG.vocab_size))
    assert float(metrics["grad_norm"]) > 0
    after = _flat(new.params)
    assert sorted(after) == sorted(before)
    for path, value in after.items():
        if any("_lora" in str(part) for part in path):
            if path[-1] == "b":  # B starts at 0; A's gradient is 0 while B is (B^T d)
                assert np.abs(value).max() > 0, path  # moved off 0
        else:
            assert value.dtype == before[path].dtype, path
            assert value.tobytes() == before[path].tobytes(), path


def test_trainer_reference_is_the_base_not_a_copy():
    """In the trainer (GRPO, KL to the reference): no copy is kept, the reference pass runs with
    the adapters off, and after an update the policy has moved away from it while the reference
    log-probs stay the base's."""
    c = toy_config("grpo", **{"lora.enabled": True, "lora.rank": 4, "optim.lr": 3e-2})
    run, state, loop, ref = make_run(c)
    assert ref is None and run.reference.kind == "adapters_off"
    calls = []
    real = run.updater.logprobs

    def spy(params, tokens, valid, reference=False):
        out = real(params, tokens, valid, reference)
        calls.append((bool(reference), params, tokens, valid, np.asarray(out)))
        return out

    run.updater.logprobs = spy
    start = jax.tree.map(jnp.copy, state.params)
    for _ in range(2):
        state, metrics, _, _ = rl_step(run, state, loop, ref)
    assert [c[0] for c in calls] == [True, True]  # one reference pass per step, adapters off
    _, _, tokens, attn, ref_logp = calls[-1]
    base_logp = np.asarray(real(start, tokens, attn))  # B = 0 at the start: the base policy
    np.testing.assert_array_equal(ref_logp, base_logp)
    assert metrics["kl_ref"] > 0  # the policy moved away from the base
    assert np.abs(np.asarray(real(state.params, tokens, attn)) - base_logp).max() > 1e-4


@pytest.fixture(scope="module", params=["qwen2-untied", "llama", "qwen3-tied", "gemma3-tied"])
def hf_lora(tmp_path_factory, request):
    """A tiny random checkpoint of each family (Qwen2 with biases, Llama, Qwen3 with QK-norm,
    Gemma 3 with sandwich norms and sliding layers), and our load of it with random
    (trained-like) adapters."""
    import transformers

    from tests.test_models import _make_hf

    root = tmp_path_factory.mktemp("lora_hf")
    _make_hf(request.param, root / "base")
    model = lora.attach(models.from_pretrained(root / "base"), SPEC, seed=0)
    for i, (_, _, adapter) in enumerate(lora.adapters(model)):
        adapter.b.set_value(0.3 * jax.random.normal(jax.random.key(i), adapter.b.shape))
    tokens = np.random.default_rng(0).integers(0, 96, size=(2, 11)).astype(np.int32)
    del transformers
    return root, model, tokens, np.asarray(model(tokens))


def test_merged_export_equals_the_adapted_logits_and_loads_in_transformers(hf_lora):
    import torch
    import transformers

    root, model, tokens, adapted = hf_lora
    merged = lora.merged(model)
    assert not jax.tree.leaves(nnx.state(merged, nnx.LoRAParam))
    ours = np.asarray(merged(tokens))
    assert np.abs(ours - adapted).max() <= 1e-5 * np.abs(adapted).max()
    models.save_pretrained(merged, root / "merged", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "merged").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, adapted, atol=1e-4, rtol=1e-4)


def test_peft_export_loaded_by_peft_gives_the_same_logits(hf_lora):
    import peft
    import torch
    import transformers

    root, model, tokens, adapted = hf_lora
    lora.save_peft(model, root / "adapter", SPEC, base_model=str(root / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base").eval()
    with torch.no_grad():
        plain = base(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    peft_model = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(plain - adapted).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(theirs, adapted, atol=1e-4, rtol=1e-4)


def test_sharded_lora_step_on_8_fake_devices_equals_the_one_device_step():
    """Adapters take the rules' axes of the weight they adapt (A: in axes + rank replicated,
    B: rank replicated + out axes); a step on data x fsdp x tensor = 2 x 2 x 2 equals one
    device's."""
    _, model = _lora_model(random_b=True)
    init = jax.device_get(nnx.state(model, nnx.Param))
    graphdef = nnx.split(model, nnx.Param)[0]
    tx, loss_fn = mp_worker.gvpo_pieces(graphdef, group_size=G, prompt_len=TP)
    batch = _rollout_batch(CFG.vocab_size)
    results = []
    for shape in ((1, 1, 1), (2, 2, 2)):
        mesh = sharding.make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
        rules = sharding.logical_rules(mesh, CFG)
        params = jax.device_put(init, sharding.param_shardings(init, mesh, rules))
        key = jax.random.key_data(jax.random.key(0))
        state, shardings = train_step.init_state_sharded(params, tx, key, mesh, rules)
        update = train_step.jit_update(loss_fn, tx, 2, mesh=mesh, state_shardings=shardings,
                                       rules=rules)  # fmt: skip
        device_batch = sharding.shard_batch(batch, mesh, group_size=G, micro_batches=2)
        new, metrics = update(state, device_batch)
        results.append((_flat(new.params), jax.device_get(metrics)))
        if shape == (2, 2, 2):
            attn = new.params["layers"][0]["attn"]
            assert attn["q_lora"]["a"].get_value().sharding.spec == P("fsdp", None)
            assert attn["q_lora"]["b"].get_value().sharding.spec == P(None, "tensor", None)
            assert attn["o_lora"]["a"].get_value().sharding.spec == P("tensor", None, None)
    (ref, m_ref), (got, m_got) = results
    np.testing.assert_allclose(float(m_got["loss"]), float(m_ref["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_got["grad_norm"]), float(m_ref["grad_norm"]), rtol=1e-6)
    moved = max(np.abs(ref[k] - v).max() for k, v in _flat(init).items())
    assert moved > 5e-3
    for k, v in got.items():
        np.testing.assert_allclose(v, ref[k], atol=1e-6, rtol=0, err_msg=str(k))


# arith_tiny with one layer, GRPO (a KL to the reference: the adapters-off pass runs), 4 steps.
RESUME = {
    "sft.steps": 0, "data.eval_size": 16, "train.eval_every": 0, "train.checkpoint_every": 2,
    "rollout.prompts_per_step": 8, "rollout.group_size": 4, "train.plot": False,
    "train.eval_samples": 1, "train.steps": 4, "model.overrides.num_layers": 1,
    "lora.enabled": True, "lora.rank": 4, "algo.name": "grpo", "mesh.num_devices": 1,
}  # fmt: skip


def _in_process(workdir):
    """The trainer in this process (saves a start-up and a compile over a subprocess)."""
    from configs import arith_tiny
    from gvpo_jax import train

    c = config_lib.set_fields(arith_tiny.get_config(), RESUME)
    config_lib.validate(c)
    return train.run(c, str(workdir))


@pytest.mark.slow
def test_lora_resume_after_sigkill_is_bit_exact_and_checkpoints_hold_no_base(tmp_path, capsys):
    """Killed after its step-2 checkpoint and resumed: the same metrics and exports as a run
    that was never stopped. The checkpoint holds the adapters and their moments only (the base
    is reloaded and checked against its fingerprint), the run exports the merged model and the
    PEFT adapters, and a run without LoRA refuses the checkpoint in one sentence."""
    import orbax.checkpoint as ocp
    from safetensors.numpy import load_file

    from tests.test_resume import _committed, _rl_rows, _wait_for

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _in_process(straight)
    flags = [f"--config.{k}={v}" for k, v in RESUME.items()]
    cmd = [sys.executable, "-m", "gvpo_jax.main", "--config=configs/arith_tiny.py",
           f"--workdir={killed}", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert _wait_for(lambda: 2 in _committed(killed), proc), proc.stderr.read()[-3000:]
    proc.kill()  # SIGKILL
    proc.wait()
    resume_from = max(_committed(killed))
    capsys.readouterr()
    _in_process(killed)
    assert f"at step {resume_from}" in capsys.readouterr().out
    rows_a, rows_b = _rl_rows(straight), _rl_rows(killed)
    assert sorted(rows_a) == sorted(rows_b) == [1, 2, 3, 4]
    for step in range(resume_from + 1, 5):
        assert rows_a[step] == rows_b[step], step
    for name in ("export/model.safetensors", "export_adapter/adapter_model.safetensors"):
        a, b = load_file(str(straight / name)), load_file(str(killed / name))
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    meta = ocp.StandardCheckpointer().metadata(killed / "checkpoints" / "4" / "state")
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    leaves = jax.tree_util.tree_leaves_with_path(tree["state"]["params"])
    paths = ["/".join(map(str, p)) for p, _ in leaves]
    assert paths and all("_lora" in p for p in paths), paths  # adapters only, no base
    # A run without LoRA is told so in one sentence, before anything is read or moved aside.
    from gvpo_jax import checkpoint, resume

    with pytest.raises(checkpoint.CheckpointError, match="set --config.lora.enabled=True"):
        resume.check_lora_layout(types.SimpleNamespace(lora=None), killed / "checkpoints", 4)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"lora.targets": "q_proj,qkv"}, "config.lora.targets names 'qkv'"),
        ({"lora.targets": "v_projj"}, "did you mean 'v_proj'"),
        ({"lora.rank": 0}, "config.lora.rank is 0"),
        ({"model.param_dtype": "bfloat16", "model.allow_bf16_params": True},
         "config.model.param_dtype is bfloat16 with lora.enabled"),
        ({"lora.dropout": 0.1}, "config.lora.dropout is 0.1"),
        ({"lora.targets": "q_proj,v_proj", "lora.experts": True},
         "config.lora.experts is True but lora.targets"),
    ],
)  # fmt: skip
def test_bad_lora_settings_fail_with_one_sentence(changes, words):
    c = config_lib.base_config()
    c.model.preset = "tiny"
    config_lib.set_fields(c, {"lora.enabled": True, **changes})
    with pytest.raises(config_lib.ConfigError, match=words):
        config_lib.validate(c)


def test_rank_above_the_layer_width_and_sft_with_a_reference_fail_before_compiling():
    c = config_lib.base_config()
    config_lib.set_fields(c, {"model.preset": "tiny", "lora.enabled": True, "lora.rank": 65})
    config_lib.validate(c)  # the widths need the model's shapes: assemble checks them
    with pytest.raises(config_lib.ConfigError, match="q_proj is only 64 wide"):
        assemble.check_lora(c, models.PRESETS["tiny"])
    config_lib.set_fields(c, {"lora.rank": 8, "sft.steps": 5})
    with pytest.raises(config_lib.ConfigError, match="not the SFT result"):
        assemble.check_lora(c, models.PRESETS["tiny"])


def test_bad_lora_target_on_the_command_line_exits_2():
    cmd = [
        sys.executable,
        "-m",
        "gvpo_jax.main",
        "--config=configs/arith_tiny.py",
        "--config.lora.enabled=True",
        "--config.lora.targets=qproj",
        "--workdir=/nonexistent",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: config.lora.targets names 'qproj'"), lines[-3:]


def test_planner_lora_keeps_the_base_in_the_compute_dtype_and_moments_of_adapters_only():
    """qwen_math with LoRA on one v5e-8 host and one 80 GB GPU (the README's rows): the bf16
    base, fp32 adapters with their moments, no reference copy, and both fit."""
    from configs import qwen_math

    c = config_lib.set_fields(qwen_math.get_config(), {"lora.enabled": True})
    host = {"optim.micro_batches": 32, "rollout.num_slots": 256, "train.eval_num_slots": 256}
    gpu = {"rollout.prompts_per_step": 256, "algo.num_minibatches": 1, "optim.micro_batches": 128,
           "rollout.num_slots": 128, "train.eval_num_slots": 128}  # fmt: skip
    v5e = plan.plan_memory(config_lib.set_fields(c.copy_and_resolve_references(), host), 8)
    assert v5e.fits(plan.DEVICE_MEMORY_GIB["v5e"]), v5e.table()
    one = plan.plan_memory(config_lib.set_fields(c.copy_and_resolve_references(), gpu), 1)
    assert one.fits(80), one.table()
    assert plan.model_config(c).param_dtype == "bfloat16"  # the base in the compute dtype
    assert 2 * 7_615_616_512 < one.params < 2 * 7_615_616_512 + 4 * 45e6  # + fp32 adapters
    assert one.reference == 0 and one.compute_copy == 0
    assert one.opt_state < 0.03 * one.params and one.gradients < 0.03 * one.params


def test_packed_groups_take_the_reference_with_the_adapters_off():
    """Length buckets with packed groups (optim.pack_groups): GRPO's KL reference comes from the
    packed log-prob pass with the adapters off, and two steps log the same KL, loss and
    parameters as the per-group bucketed layout."""
    runs = {}
    for pack in (False, True):
        c = toy_config("grpo", **{"lora.enabled": True, "lora.rank": 2, "optim.length_buckets": 2,
                                  "optim.pack_groups": pack})  # fmt: skip
        run, state, loop, ref = make_run(c)
        assert ref is None and run.reference.kind == "adapters_off"
        metrics = []
        for t in (1, 2):
            state, m, _, _ = rl_step(run, state, loop, ref)
            loop.step = t
            metrics.append((m["kl_ref"], m["loss"]))
        runs[pack] = metrics, jax.tree.leaves(nnx.state(state.params, nnx.LoRAParam))
    assert runs[True][0][1][0] > 0  # the policy moved away from the base: a real KL
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-7)
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
