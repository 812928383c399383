"""Device mesh, logical-axis rules, sharded init and placement, batch sharding, multi-host helpers.

The distributed engine is JAX's own: one program per process (`jax.distributed`), GSPMD inside
`jax.jit`. This module only says where arrays live:

* Mesh axes `("data", "fsdp", "tensor")`. Rows of a batch are split over `data` x `fsdp`;
  parameters and optimizer state are split over `fsdp` (ZeRO-3 / FSDP) and `tensor` (Megatron-
  style tensor parallelism: attention heads, MLP width, vocabulary).
* The model names the axes of every parameter and activation (`models.PARAM_AXES`,
  `models.ACTIVATION_AXES`); `logical_rules` maps those names onto mesh axes. Flax applies the
  rules in order and never uses a mesh axis twice in one array, so activations whose `batch`
  axis already took `fsdp` keep `embed` whole (FSDP gathers weights, not activations).
* Batches hold whole groups: rows `g*G .. g*G+G-1` are one prompt's responses, so every shard
  must hold a whole number of groups (`check_batch`), and the loss never crosses shards for a
  group mean (GSPMD all-reduces only the final sums).

Constraints (checked by `logical_rules` with a model config):
  heads % tensor == 0, mlp % tensor == 0, vocab % tensor == 0, embed % fsdp == 0;
  kv_heads % tensor != 0 replicates the K/V projections (GQA with few KV heads, as MaxText).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gvpo_jax import models
from gvpo_jax.errors import BadInputError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # rows of a batch are split over these (whole groups per shard)
# With expert parallelism (`make_mesh(..., expert=n)`, n > 1) a fourth axis splits an MoE
# layer's experts; outside the MoE layers it is one more data-parallel axis (rows split over it
# too, every other weight replicated along it).
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "tensor")
EXPERT_BATCH_AXES = ("data", "fsdp", "expert")

# Logical name -> mesh axis (None: replicated). Order matters for activations: `batch` first,
# so that an activation [batch, length, embed] gets ((data, fsdp), None, None).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("batch_data", "data"),  # rows split over data only (replicated over fsdp), e.g. token ids
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
    ("cache_length", None),
    ("layers", None),  # stacked blocks (ModelConfig.scan_layers): each device keeps every layer
    ("expert", None),  # an MoE layer's experts [E, ...]
    ("expert_mlp", "tensor"),  # an expert's MLP width
    ("router", None),  # the router's output (one logit per expert)
)
# Where the mesh has an `expert` axis (`logical_rules` adapts LOGICAL_RULES to it).
EXPERT_RULES = {"batch": EXPERT_BATCH_AXES, "expert": "expert"}

# Model-config field behind each sharded parameter axis (for the divisibility checks).
_AXIS_SIZE_FIELD = {
    "vocab": "vocab_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "mlp": "intermediate_size",
    "embed": "hidden_size",
    "expert_mlp": "moe_intermediate_size",
    "expert": "num_experts",
}


class ShardingError(BadInputError):
    """A mesh / batch / model combination that cannot be sharded; the message names the fix."""


# ----------------------------------------------------------------------------------------------
# Mesh and rules


def mesh_shape(
    data: int = -1, fsdp: int = 1, tensor: int = 1, *, num_devices: int, expert: int = 1
) -> tuple:
    """Resolves one -1 entry to fill `num_devices` (with `expert` > 1, the expert axis counts
    too); returns (data, fsdp, tensor) sizes."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    if expert != 1:
        sizes["expert"] = expert
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ShardingError(
            f"mesh sizes {sizes} have more than one -1; set all but one axis explicitly."
        )
    for k, v in sizes.items():
        if v != -1 and (not isinstance(v, int) or v < 1):
            raise ShardingError(f"mesh.{k}={v!r}; use a positive size or -1 to fill the rest.")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if num_devices % fixed:
            raise ShardingError(
                f"{num_devices} devices cannot be split into a mesh with {sizes} "
                f"({fixed} does not divide {num_devices}); change the mesh sizes."
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ShardingError(
            f"mesh {sizes} needs {fixed} devices but {num_devices} are available; "
            "set one axis to -1 or match the device count."
        )
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None, *, expert: int = 1
) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes); with
    `expert` > 1, a (data, fsdp, expert, tensor) mesh (`EXPERT_MESH_AXES`).

    Axis types are Auto (GSPMD propagation). Device order comes from `jax.make_mesh` (a ring over
    the physical topology on TPUs; the given order elsewhere); on multi-slice TPUs `data` is
    split across slices (`create_hybrid_device_mesh`) so only gradient all-reduces cross DCN.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, num_devices=len(devices), expert=expert)
    if expert != 1:
        if expert < 1:
            raise ShardingError(f"mesh.expert={expert}; use a positive size (1: no experts axis).")
        auto = (jax.sharding.AxisType.Auto,) * 4
        full = (shape[0], shape[1], expert, shape[2])
        return jax.make_mesh(full, EXPERT_MESH_AXES, axis_types=auto, devices=devices)
    auto = (jax.sharding.AxisType.Auto,) * 3
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:  # multi-slice TPU: `data` crosses the slow links (DCN) between slices
        from jax.experimental import mesh_utils

        n = len(slices)
        if shape[0] % n:
            raise ShardingError(
                f"{n} TPU slices need mesh.data to be a multiple of {n} (data parallel across "
                f"slices), got data={shape[0]}."
            )
        grid = mesh_utils.create_hybrid_device_mesh(
            (shape[0] // n, shape[1], shape[2]), (n, 1, 1), devices
        )
        return jax.sharding.Mesh(grid, MESH_AXES, axis_types=auto)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def mesh_sizes(mesh) -> dict[str, int]:
    """{'data': d, 'fsdp': f, 'tensor': t} of a Mesh or AbstractMesh."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def _mesh_size(sizes: Mapping[str, int], target) -> int:
    if target is None:
        return 1
    names = (target,) if isinstance(target, str) else target
    return math.prod(sizes.get(n, 1) for n in names)


def logical_rules(mesh, model_cfg: models.ModelConfig) -> tuple:
    """LOGICAL_RULES, checked against (and adapted to) a mesh and a model's shapes.

    Raises ShardingError when a sharded parameter dimension is not divisible by its mesh axis
    (e.g. heads % tensor); kv_heads not divisible by tensor falls back to replicated K/V
    projections (the usual choice for GQA with fewer KV heads than tensor shards).
    """
    sizes = mesh_sizes(mesh)
    rules = []
    for name, target in LOGICAL_RULES:
        if "expert" in sizes:
            target = EXPERT_RULES.get(name, target)
        field = _AXIS_SIZE_FIELD.get(name)
        n = _mesh_size(sizes, target)
        if field is not None and n > 1 and getattr(model_cfg, field) % n:
            dim = getattr(model_cfg, field)
            if name == "kv_heads":
                target = None  # replicate K/V; queries stay split over heads
            else:
                raise ShardingError(
                    f"model {field}={dim} is not divisible by mesh axis {target!r} of size {n}; "
                    f"pick mesh.{target} dividing {dim} (logical axis {name!r})."
                )
        rules.append((name, target))
    return tuple(rules)


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules=LOGICAL_RULES):
    """Mesh + logical-axis rules for code traced inside (activation constraints become real).

    Wrap calls of functions jitted elsewhere (e.g. `sampler.generate`) with it; jax keys its
    compilation cache on the active mesh, so a call inside and one outside never share a trace.
    """
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


@contextlib.contextmanager
def tracing_mesh(mesh, rules):
    """Inside a traced function: the abstract mesh and rules for `with_logical_constraint`."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(rules):
        yield


# ----------------------------------------------------------------------------------------------
# Parameters and state


def state_shardings(tree, mesh: jax.sharding.Mesh, rules=LOGICAL_RULES):
    """NamedSharding for every leaf of `tree` (abstract or concrete).

    Leaves inside nnx Variables (parameters, and the Adam moments optax builds from them) follow
    their logical axis names through `rules`; every other leaf (step, PRNG key, counters) is
    replicated. The result has the structure of `tree` (Variables kept), as jit shardings need.
    """
    with nnx.logical_axis_rules(rules):
        return nnx.get_named_sharding(tree, mesh)


def param_shardings(abstract_params_or_model, mesh: jax.sharding.Mesh, rules=LOGICAL_RULES):
    """Shardings of `nnx.state(model, nnx.Param)`; pass a model (abstract or not) or that state."""
    tree = abstract_params_or_model
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    return state_shardings(tree, mesh, rules)


def abstract(tree):
    """Each array of `tree` as a ShapeDtypeStruct with its sharding (and weak type): what
    `jit(...).lower` needs of it, without holding its buffers."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding, weak_type=x.aval.weak_type
        ),
        tree,
    )


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs carrying shardings (restore targets for Orbax, `jit(...).lower`)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings
    )


def init_sharded(
    model_cfg: models.ModelConfig, mesh: jax.sharding.Mesh, seed: int, rules=None
) -> models.Transformer:
    """`Transformer(model_cfg, rngs=nnx.Rngs(seed))` created directly in its shards.

    The init runs under `jax.jit` with the parameter shardings as `out_shardings`, so every
    device computes only its own slice (never a full copy on one device); the values equal an
    unsharded init with the same seed (threefry keys are independent of the sharding). The
    draws are `nnx.Rngs(seed)`'s, through `models.KeyStream` (no counter to update while
    tracing).
    """
    rules = logical_rules(mesh, model_cfg) if rules is None else rules
    graphdef, abstract = nnx.split(models.abstract_model(model_cfg))
    shardings = state_shardings(abstract, mesh, rules)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        rngs = models.KeyStream(jax.random.key(seed))  # nnx.Rngs(seed)'s draws
        return nnx.state(models.Transformer(model_cfg, rngs=rngs))

    return nnx.merge(graphdef, init())


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, rules=None) -> nnx.Module:
    """Moves an already built model (e.g. from GGUF) onto its shardings; returns a new module.

    A Hugging Face directory loads straight into its shards instead: `models.from_pretrained(...,
    shardings=param_shardings(models.abstract_model(cfg), mesh, rules))`."""
    rules = logical_rules(mesh, model.config) if rules is None else rules
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh, rules)))


# ----------------------------------------------------------------------------------------------
# Batches


def batch_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a batch's rows are split over: data x fsdp (x expert, when the mesh has
    one)."""
    return EXPERT_BATCH_AXES if "expert" in mesh.axis_names else BATCH_AXES


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Rows over data x fsdp (x expert), every other dimension whole; a prefix for any batch
    pytree."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_shards(mesh) -> int:
    """Number of row shards (data x fsdp, x expert when the mesh has one)."""
    sizes = mesh_sizes(mesh)
    return math.prod(sizes[a] for a in batch_axes(mesh))


def check_split(count: int, mesh, what: str, fix: str) -> None:
    """Raises ShardingError unless `count` (rows, prompts, slots) splits evenly over the row
    shards (data x fsdp). The one divisibility check of the package: the config's batch sizes
    (`assemble.check_mesh`, also the planner's verdict), the sampler and the data loading use
    it. `what` names the quantity (e.g. "config.rollout.num_slots"), `fix` says what to do."""
    shards = batch_shards(mesh)
    if count % shards:
        raise ShardingError(
            f"{what} = {count} cannot be split over the {shards} {' x '.join(batch_axes(mesh))} "
            f"shards of the mesh; {fix}."
        )


def check_batch(num_rows: int, group_size: int, mesh, micro_batches: int = 1) -> None:
    """Raises ShardingError unless every (shard, micro-batch) slice holds whole groups."""
    shards = batch_shards(mesh)
    if num_rows % group_size:
        raise ShardingError(
            f"{num_rows} rows are not whole groups of {group_size}; lay out P x G rows."
        )
    groups = num_rows // group_size
    if groups % (shards * micro_batches):
        axes = " x ".join(batch_axes(mesh))
        raise ShardingError(
            f"{groups} groups cannot be split evenly over {shards} {axes} shards x "
            f"{micro_batches} micro-batches (whole groups per shard); make the groups per "
            f"update a multiple of {shards * micro_batches} (rollout.prompts_per_step / "
            f"algo.num_minibatches) or shrink mesh.{axes.replace(' x ', ' x mesh.')}."
        )


def _row_shard_sets(mesh) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Distinct sets of row shards (data x fsdp positions) held by the processes, and this
    process's set. Replicas (e.g. a tensor axis spanning hosts) share one set. On TPU pods a
    host's devices need not be neighbours along the row axis, so a set may be non-contiguous.
    """
    shards = batch_shards(mesh)
    by_process: dict[int, set[int]] = {}
    for device, (rows,) in batch_sharding(mesh).devices_indices_map((shards,)).items():
        by_process.setdefault(device.process_index, set()).add(rows.indices(shards)[0])
    sets = {p: tuple(sorted(v)) for p, v in by_process.items()}
    distinct = sorted(set(sets.values()))
    if sum(len(x) for x in distinct) != shards or len({len(x) for x in distinct}) != 1:
        raise ShardingError(
            f"processes hold overlapping or unequal sets of the {shards} row shards "
            f"({distinct}); build the mesh with sharding.make_mesh."
        )
    return distinct, sets[jax.process_index()]


class ProcessRows(NamedTuple):
    """The rows of a global batch that this process feeds (see `process_rows`)."""

    rows: np.ndarray  # int64 global row indices, ascending; local row i is global rows[i]
    index: int  # this process's data shard (replicas of the same rows share an index)
    count: int  # number of distinct data shards (processes / replicas per shard)


def process_rows(num_rows: int, mesh) -> ProcessRows:
    """Which rows of a `num_rows`-row global batch this process reads and feeds.

    Each process loads only `len(rows)` examples per batch, as shard `index` of `count` of the
    data (e.g. grain's ShardOptions); passed to `shard_batch` in that order, local row i lands
    at global row `rows[i]`. Processes that are replicas of the same rows must feed identical
    data. With one process: all rows, index 0 of 1.
    """
    check_split(num_rows, mesh, "rows", "use a multiple")
    shards = batch_shards(mesh)
    distinct, mine = _row_shard_sets(mesh)
    per = num_rows // shards
    rows = np.concatenate([np.arange(s * per, (s + 1) * per) for s in mine])
    return ProcessRows(rows=rows, index=distinct.index(mine), count=len(distinct))


def shard_batch(
    batch: Mapping[str, np.ndarray],
    mesh: jax.sharding.Mesh,
    *,
    group_size: int | None = None,
    micro_batches: int = 1,
    process_local: bool = True,
) -> dict[str, jax.Array]:
    """Global row-sharded arrays from host rows.

    process_local=True: `batch` holds only this process's rows, local row i being global row
    `process_rows(...).rows[i]` (`jax.make_array_from_process_local_data`). In a single-process
    run that is the whole batch. process_local=False: every process passes the same full batch.
    With `group_size`, checks that every (shard, micro-batch) slice holds whole groups.
    """
    sharding = batch_sharding(mesh)
    num_blocks = len(_row_shard_sets(mesh)[0]) if process_local else 1
    out = {}
    for name, value in batch.items():
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            out[name] = value if value.sharding == sharding else jax.device_put(value, sharding)
            continue  # already a global array (e.g. log-probs computed under the mesh)
        value = np.asarray(value)
        rows = value.shape[0] * num_blocks
        if group_size is not None:
            check_batch(rows, group_size, mesh, micro_batches)
        if jax.process_count() == 1:
            out[name] = jax.device_put(value, sharding)
        elif process_local:
            out[name] = jax.make_array_from_process_local_data(
                sharding, value, (rows, *value.shape[1:])
            )
        else:
            out[name] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
    return out


def device_batch(
    batch: Mapping[str, np.ndarray],
    mesh,
    *,
    group_size: int | None = None,
    micro_batches: int = 1,
    local: bool = False,
) -> dict[str, jax.Array]:
    """A host batch as the jitted functions' input: global arrays split by rows over the mesh.

    `batch` is the global batch, identical on every process (each feeds its `process_rows`), or
    with local=True this process's rows only. With `group_size`, checks whole groups per shard.
    """
    if not local:
        rows = process_rows(len(next(iter(batch.values()))), mesh).rows
        batch = {k: np.asarray(v)[rows] for k, v in batch.items()}
    return shard_batch(batch, mesh, group_size=group_size, micro_batches=micro_batches)


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded (or replicated) global array, as numpy, in order."""
    if jax.process_count() == 1 or x.ndim == 0:
        return np.asarray(x)
    pieces = {}
    for shard in x.addressable_shards:
        if shard.data.shape[1:] != x.shape[1:]:
            raise ShardingError(
                f"array of shape {x.shape} is split along more than its rows "
                f"({x.sharding}); only row-sharded arrays have process-local rows."
            )
        pieces.setdefault(shard.index[0].indices(x.shape[0])[0], np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=0)


def gather(tree):
    """Every leaf as a full numpy array on every process (an all-gather across processes)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def gather_rows(batch: Mapping[str, np.ndarray], mesh) -> dict[str, np.ndarray]:
    """The full global batch on every process, from each process's local rows (numpy in/out).

    `batch` holds this process's rows in `process_rows` order (as for `shard_batch`); the result
    has every row in global order, identical on all processes (an all-gather across processes).
    Single process: the batch itself (no copy, no device round trip).
    """
    if jax.process_count() == 1:
        return {k: np.asarray(v) for k, v in batch.items()}
    return gather(shard_batch(batch, mesh))


def data_shard(mesh) -> tuple[int, int]:
    """(index, count): this process's data shard, as `process_rows(...).index/.count`."""
    rows = process_rows(batch_shards(mesh), mesh)
    return rows.index, rows.count


def host_allgather(x) -> np.ndarray:
    """A host value of every process, stacked along a new leading axis [num_processes, ...].

    Every process must call it (a collective); shapes and dtypes must agree across processes.
    """
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def sum_over_shards(value: float, mesh) -> float:
    """Sum of a per-process host count over the distinct data shards (replicas counted once)."""
    if jax.process_count() == 1:
        return float(value)
    index, _ = data_shard(mesh)
    pairs = host_allgather(np.array([index, value], np.float64))
    return float(sum({int(i): v for i, v in pairs}.values()))


# ----------------------------------------------------------------------------------------------
# Multi-host


def is_primary() -> bool:
    """True on process 0: the one process that writes metrics, samples and exports."""
    return jax.process_index() == 0


def maybe_initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    mode: str = "auto",
) -> bool:
    """Starts JAX's multi-controller runtime when asked; returns whether it is running.

    Call before anything touches a device. Arguments override the environment variables
    JAX_COORDINATOR_ADDRESS ("host:port"), JAX_NUM_PROCESSES and JAX_PROCESS_ID.
    mode: "off" never initializes; "on" always does (JAX auto-detects TPU pods, SLURM, Open MPI
    for anything not given); "auto" initializes when an address is given or in the environment,
    when GVPO_DISTRIBUTED=1 (set by launch/tpu_pod.sh), or inside a multi-task SLURM step.
    """
    if mode not in ("auto", "on", "off"):
        raise ShardingError(f"distributed mode {mode!r}; use auto, on or off.")
    if jax.distributed.is_initialized():
        return True
    if mode == "off":
        return False
    env = os.environ
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    nproc = num_processes if num_processes is not None else env.get("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else env.get("JAX_PROCESS_ID")
    wanted = (
        mode == "on"
        or address is not None
        or env.get("GVPO_DISTRIBUTED", "") == "1"
        or int(env.get("SLURM_NTASKS", "1")) > 1
    )
    if not wanted:
        return False
    if address is not None and (nproc is None or pid is None):
        raise ShardingError(
            f"coordinator address {address!r} is set but the number of processes or this "
            "process's id is not; set JAX_NUM_PROCESSES and JAX_PROCESS_ID (or pass both)."
        )
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=None if nproc is None else int(nproc),
        process_id=None if pid is None else int(pid),
    )
    return True
