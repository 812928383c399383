"""The planner on mixture-of-experts models: total and active parameters of Qwen3-30B-A3B, the
experts' weights per device, the dispatch buffers against XLA's compiled programs, and the
verdicts of the README's targets (shapes only: nothing of 30B size is compiled)."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gvpo_jax import config as config_lib
from gvpo_jax import models, plan, sharding
from gvpo_jax.models import moe as moe_lib
from gvpo_jax.models.transformer import MoE

QWEN3_30B_A3B = 30_532_122_624  # jax.eval_shape of the preset


def moe_config(target: str, lora: bool = False):
    """configs/qwen3_math.py on Qwen3-30B-A3B's shapes, meshed for one of the README's targets:
    a TPU v5p-64 (32 chips, FSDP), a v5e-64 (64 chips, fsdp 16 x tensor 4, 16 micro-batches) or
    one node of 8 x 80 GB GPUs (FSDP, qwen3_math's one-GPU overrides)."""
    from configs import qwen3_math

    c = qwen3_math.get_config()
    fields = {"model.preset": "qwen3-30b-a3b", "model.hf_dir": "", "lora.enabled": lora}
    fields.update({
        "v5p-64": {"mesh.data": 1, "mesh.fsdp": 32, "mesh.tensor": 1},
        "v5e-64": {"mesh.data": 1, "mesh.fsdp": 16, "mesh.tensor": 4, "optim.micro_batches": 16},
        "8xh100": {"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1, "optim.micro_batches": 32,
                   "rollout.num_slots": 128, "train.eval_num_slots": 128},
    }[target])  # fmt: skip
    return config_lib.set_fields(c, fields)


def test_qwen3_30b_a3b_total_and_active_parameters():
    """Active parameters per token: every weight but the 120 of 128 experts a token skips in
    each of the 48 layers (embedding and head untied, both counted); the published "3.3B
    activated" is this count rounded."""
    cfg = plan.model_config(moe_config("v5p-64"))  # (the plans below reuse its traced shapes)
    assert cfg.num_experts == 128 and cfg.scan_layers
    counts = plan.param_counts(cfg)
    assert counts.total == models.param_count(models.abstract_model(cfg)) == QWEN3_30B_A3B
    V, D, L, Nh, Kh, H = 151936, 2048, 48, 32, 4, 128  # vocab, width, layers, heads, KV, head
    E, k, F = 128, 8, 768  # experts, experts per token, an expert's width
    attention = D * Nh * H + 2 * D * Kh * H + Nh * H * D + 2 * H  # q, k, v, o, q/k norms
    per_layer = attention + 2 * D + D * E  # + the two norms and the router
    shared = 2 * V * D + L * per_layer + D  # + embedding, head and the final norm
    assert counts.experts == L * E * 3 * D * F
    assert counts.total == shared + L * E * 3 * D * F
    assert counts.active == shared + L * k * 3 * D * F == 3_353_032_704
    dense = plan.param_counts(models.PRESETS["qwen3-1.7b"])
    assert dense.active == dense.total and dense.experts == 0


TARGETS = {"v5p-64": (32, "v5p"), "v5e-64": (64, "v5e"), "8xh100": (8, "h100")}


@pytest.mark.parametrize(
    "target,lora,fits",
    [("v5p-64", False, True), ("v5e-64", False, True), ("8xh100", False, False),
     ("8xh100", True, True)],
)  # fmt: skip
def test_qwen3_30b_a3b_verdicts_on_the_readme_targets(target, lora, fits):
    """Full fine-tuning fits the TPU slices and not one 8-GPU node (fp32 masters, AdamW moments
    and gradient accumulator: 71 GiB a GPU before any activation); LoRA fits all three. The
    experts' weights per device are exact: [E, D, F] split D over fsdp and F over tensor."""
    devices, kind = TARGETS[target]
    c = moe_config(target, lora)
    p = plan.plan_memory(c, devices)
    assert not any("NOT RUNNABLE" in n for n in p.notes), p.notes
    assert p.fits(plan.DEVICE_MEMORY_GIB[kind]) == fits, p.table()
    fsdp, tensor = c.mesh.fsdp, c.mesh.tensor
    itemsize = 2 if lora else 4  # LoRA: the frozen base in bf16; full: fp32 masters
    assert p.experts == 48 * 3 * 128 * (2048 // fsdp) * (768 // tensor) * itemsize
    assert p.experts < p.params < 1.1 * p.experts  # experts are 95% of the weights
    assert 0 < p.moe_dispatch < p.activations
    text = plan.report(c, devices, kind)
    assert "3,353,032,704 active parameters per token" in text
    assert ("DOES NOT FIT" in text) != fits


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_grouped_dispatch_bytes_against_xla(shape):
    """`moe_layer_bytes` of the grouped path (CPU's) within 40% of XLA's temporaries for one
    MoE layer's forward + backward on 8 x 1024 tokens (`transformer.MoE` as the trainer runs
    it: under the mesh, each batch shard dispatching its own tokens), its weights and tokens
    split as the trainer splits them."""
    d, f, e, k, rows, length = 128, 64, 16, 4, 8, 1024
    devices = jax.devices()[: math.prod(shape)]
    mesh = sharding.make_mesh(*shape, devices=devices)
    cfg = models.PRESETS["tiny-moe"].replace(
        hidden_size=d, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
        moe_dispatch="grouped",
    )  # fmt: skip
    rules = sharding.logical_rules(mesh, cfg)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0))))
    shardings = sharding.state_shardings(state, mesh, rules)
    w = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                     state, shardings)  # fmt: skip
    x = jax.ShapeDtypeStruct((rows, length, d), jnp.float32, sharding=sharding.batch_sharding(mesh))

    def loss(w, x):
        with sharding.tracing_mesh(mesh, rules):
            y, _ = nnx.merge(graphdef, w)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile()
    xla = compiled.memory_analysis().temp_size_in_bytes
    sizes = dict(zip(sharding.MESH_AXES, shape, strict=True))
    estimate = plan.moe_layer_bytes(cfg, rows, length, sizes, dispatch="grouped")
    assert 0.6 <= estimate / xla <= 1.4, (estimate / 2**20, xla / 2**20)


def test_dispatch_bytes_grouped_pads_ragged_does_not():
    """On one device: ragged holds N*k rows; grouped at most E*(block - 1) more, rounded to a
    block, with (from `moe.SCAN_FROM_BLOCKS` blocks, `moe.block_mlp`) the rows' cotangents and
    the fp32 weight-gradient sums, or (below) the per-block gathered weights; both replace the
    dense MLP's term in the activations."""
    cfg = models.PRESETS["qwen3-30b-a3b"].replace(compute_dtype="bfloat16")
    one = {"data": 1, "fsdp": 1, "tensor": 1}
    n, d, f, e, k = 4 * 2048, 2048, 768, 128, 8
    router = n * e * (2 + 4)
    ragged = plan.moe_layer_bytes(cfg, 4, 2048, one, dispatch="ragged")
    assert ragged == 2 * n * k * (2 * d + 3 * f) + router
    grouped = plan.moe_layer_bytes(cfg, 4, 2048, one, dispatch="grouped")
    block = moe_lib.block_size(n * k, e, cfg.moe_block)
    assert block == 64
    blocks = -(-(n * k + e * (block - 1)) // block)
    assert blocks >= moe_lib.SCAN_FROM_BLOCKS
    assert grouped == 2 * (blocks * block * (2 * d + 2 * f) + n * k * d) + 12 * e * d * f + router
    small = cfg.replace(num_experts=4, num_experts_per_tok=2)  # 128 assignments: 8 blocks of 32
    gathered = plan.moe_layer_bytes(small, 1, 64, one, dispatch="grouped")
    assert gathered == 2 * (8 * 32 * (d + 3 * f) + 128 * d + 6 * 8 * d * f) + 64 * 4 * (2 + 4)
    assert plan.planned_dispatch(cfg) == "ragged"  # `auto` as on TPU and GPU
    # Each of the data x fsdp batch shards dispatches its own rows (1 of the 4 here), with
    # whole D-wide rows; tensor parallelism splits the experts' width.
    split = plan.moe_layer_bytes(cfg, 4, 2048, {"data": 2, "fsdp": 2, "tensor": 4}, "ragged")
    assert split == 2 * (n // 4) * k * (2 * d + 3 * f // 4) + (n // 4) * e * (2 + 4)
    # In the activations, an MoE layer's dispatch takes the place of the dense MLP's gate, up
    # and (unscanned) hidden [N, F]: in every layer, or (remat) in the one layer recomputed at
    # a time.
    dense = cfg.replace(architecture="qwen3", num_experts=0)
    assert not cfg.scan_layers and plan.dense_mlp_kept(cfg) == 3
    mlp = 2 * n * 3 * cfg.intermediate_size
    for remat, layers in ((False, 48), (True, 1)):
        moe_bytes = plan.activation_bytes(cfg.replace(remat=remat), 4, 2048, one, 256)
        dense_bytes = plan.activation_bytes(dense.replace(remat=remat), 4, 2048, one, 256)
        assert moe_bytes - dense_bytes == pytest.approx(layers * (ragged - mlp), abs=64)


def test_expert_parallel_dispatch_bytes_against_xla():
    """With an expert axis (expert 4 x data 2), `moe_layer_bytes` adds the exchange's three
    [ep, N*k, D] buffers and the local experts on ep * N*k rows: within 40% of XLA's
    temporaries for one layer's forward + backward, each device holding 4 of the 16 experts."""
    d, f, e, k, rows, length = 128, 64, 16, 4, 8, 256
    mesh = sharding.make_mesh(2, 1, 1, expert=4)
    cfg = models.PRESETS["tiny-moe"].replace(
        hidden_size=d, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
        moe_dispatch="grouped",
    )  # fmt: skip
    rules = sharding.logical_rules(mesh, cfg)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0))))
    shardings = sharding.state_shardings(state, mesh, rules)
    assert shardings["gate_kernel"].get_value().spec[0] == "expert"
    w = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                     state, shardings)  # fmt: skip
    x = jax.ShapeDtypeStruct((rows, length, d), jnp.float32, sharding=sharding.batch_sharding(mesh))

    def loss(w, x):
        with sharding.tracing_mesh(mesh, rules):
            y, _ = nnx.merge(graphdef, w)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile()
    xla = compiled.memory_analysis().temp_size_in_bytes
    estimate = plan.moe_layer_bytes(cfg, rows, length, sharding.mesh_sizes(mesh), "grouped")
    assert 0.6 <= estimate / xla <= 1.4, (estimate / 2**20, xla / 2**20)
