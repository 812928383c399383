"""Hugging Face checkpoint import/export: config.json + (sharded) safetensors <-> Transformer.

Loading into shards takes the shardings as an argument (`from_pretrained(..., shardings=...)`,
built by `sharding.param_shardings` from `hf_model_config`'s shapes), so the model code never
imports the mesh code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gvpo_jax.models import safetensors_io
from gvpo_jax.models.config import (
    CheckpointError,
    ModelConfig,
    config_from_hf,
    config_to_hf,
    read_hf_config,
)
from gvpo_jax.models.transformer import Transformer, abstract_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Non-parameter buffers that some exporters include; transformers ignores them too.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One HF tensor <-> one model parameter, with layout conversions both ways."""

    hf_name: str
    path: tuple  # nnx state path, e.g. ('layers', 0, 'attn', 'q_kernel')
    hf_shape: tuple[int, ...]
    to_model: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    expert: int | None = None  # an expert's slice [e] of a parameter stacked [E, ...] (MoE)


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    """The HF <-> model parameter correspondence for `cfg` (Qwen2, Qwen3, Llama and Gemma 3
    share names; Qwen3 and Gemma 3 add `self_attn.q_norm.weight` / `k_norm.weight` [head_dim],
    Gemma 3 its post-attention and pre / post-feedforward norms; its norm weights are stored as
    transformers does, the w of (1 + w))."""
    d, n, k, h, f, v = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    same = lambda x: x
    transpose = lambda x: x.T

    def in_proj(heads):  # HF [heads*H, D] <-> ours [D, heads, H]
        return (lambda x: x.T.reshape(d, heads, h), lambda x: x.reshape(d, heads * h).T)

    def bias(heads):  # HF [heads*H] <-> ours [heads, H]
        return (lambda x: x.reshape(heads, h), lambda x: x.reshape(heads * h))

    # HF o_proj [D, N*H] <-> ours [N, H, D]
    out_proj = (lambda x: x.T.reshape(n, h, d), lambda x: x.reshape(n * h, d).T)

    maps = [TensorMap("model.embed_tokens.weight", ("embedding",), (v, d), same, same)]
    for i in range(cfg.num_layers):
        pre, at = f"model.layers.{i}.", ("layers", i, "attn")
        maps += [
            TensorMap(pre + "self_attn.q_proj.weight", (*at, "q_kernel"), (n * h, d), *in_proj(n)),
            TensorMap(pre + "self_attn.k_proj.weight", (*at, "k_kernel"), (k * h, d), *in_proj(k)),
            TensorMap(pre + "self_attn.v_proj.weight", (*at, "v_kernel"), (k * h, d), *in_proj(k)),
            TensorMap(pre + "self_attn.o_proj.weight", (*at, "o_kernel"), (d, n * h), *out_proj),
        ]
        if cfg.attention_bias:
            maps += [
                TensorMap(pre + "self_attn.q_proj.bias", (*at, "q_bias"), (n * h,), *bias(n)),
                TensorMap(pre + "self_attn.k_proj.bias", (*at, "k_bias"), (k * h,), *bias(k)),
                TensorMap(pre + "self_attn.v_proj.bias", (*at, "v_bias"), (k * h,), *bias(k)),
            ]
        if cfg.qk_norm:
            maps += [
                TensorMap(
                    pre + "self_attn.q_norm.weight", (*at, "q_norm", "scale"), (h,), same, same
                ),
                TensorMap(
                    pre + "self_attn.k_norm.weight", (*at, "k_norm", "scale"), (h,), same, same
                ),
            ]
        ml = ("layers", i, "mlp")
        if cfg.moe_layer(i):  # the router [E, D] and each expert's projections, on disk
            e, fe = cfg.num_experts, cfg.moe_intermediate_size
            maps.append(
                TensorMap(pre + "mlp.gate.weight", (*ml, "router_kernel"), (e, d), *[transpose] * 2)
            )
            for x in range(e):
                ex = f"{pre}mlp.experts.{x}."
                maps += [
                    TensorMap(ex + "gate_proj.weight", (*ml, "gate_kernel"), (fe, d),
                              transpose, transpose, x),
                    TensorMap(ex + "up_proj.weight", (*ml, "up_kernel"), (fe, d),
                              transpose, transpose, x),
                    TensorMap(ex + "down_proj.weight", (*ml, "down_kernel"), (d, fe),
                              transpose, transpose, x),
                ]  # fmt: skip
        else:
            maps += [
                TensorMap(pre + "mlp.gate_proj.weight", (*ml, "gate_kernel"), (f, d),
                          transpose, transpose),
                TensorMap(pre + "mlp.up_proj.weight", (*ml, "up_kernel"), (f, d),
                          transpose, transpose),
                TensorMap(pre + "mlp.down_proj.weight", (*ml, "down_kernel"), (d, f),
                          transpose, transpose),
            ]  # fmt: skip
        maps += [
            TensorMap(
                pre + "input_layernorm.weight",
                ("layers", i, "attn_norm", "scale"),
                (d,),
                same,
                same,
            ),
        ]
        # Gemma 3's sandwich norms: HF's post_attention_layernorm normalises the attention
        # output there, and pre_feedforward_layernorm is the norm before the MLP.
        norms = {"post_attention_layernorm": "mlp_norm"}
        if cfg.gemma:
            norms = {
                "post_attention_layernorm": "post_attn_norm",
                "pre_feedforward_layernorm": "mlp_norm",
                "post_feedforward_layernorm": "post_mlp_norm",
            }
        for hf_norm, ours in norms.items():
            maps.append(
                TensorMap(pre + hf_norm + ".weight", ("layers", i, ours, "scale"), (d,), same, same)
            )
    maps.append(TensorMap("model.norm.weight", ("final_norm", "scale"), (d,), same, same))
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head.weight", ("lm_head",), (v, d), same, same))
    return maps


def _open_checkpoint(hf_dir: Path) -> dict[str, safetensors_io.SafetensorsFile]:
    """Maps every tensor name to the opened safetensors file holding it (headers only)."""
    index_path = hf_dir / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = list(weight_map.items()) if isinstance(weight_map, dict) else None
        except OSError as e:
            raise CheckpointError(
                f"{index_path} cannot be read ({e.strerror or e}); check that it is a readable "
                "file."
            ) from e
        except (ValueError, KeyError, TypeError) as e:  # not JSON, not an object, no weight_map
            raise CheckpointError(
                f"{index_path} has no valid 'weight_map' ({type(e).__name__}: {e}); re-download "
                "or re-export the checkpoint."
            ) from e
        if names is None or not all(isinstance(v, str) and v for _, v in names):
            raise CheckpointError(
                f"{index_path}: 'weight_map' must map tensor names to shard file names; "
                "re-download or re-export the checkpoint."
            )
        files = {}
        for name in sorted(set(weight_map.values())):
            if not (hf_dir / name).exists():
                raise CheckpointError(
                    f"{index_path} lists '{name}', which is missing from {hf_dir}; "
                    "copy the missing shard into the directory."
                )
            files[name] = safetensors_io.SafetensorsFile(hf_dir / name)
        by_tensor = {}
        for tensor, name in weight_map.items():
            if tensor not in files[name].header:
                raise CheckpointError(
                    f"{index_path} maps tensor '{tensor}' to '{name}', which does not contain it; "
                    "re-export the checkpoint."
                )
            by_tensor[tensor] = files[name]
        return by_tensor
    if (hf_dir / SINGLE_FILE).exists():
        single = safetensors_io.SafetensorsFile(hf_dir / SINGLE_FILE)
        return {name: single for name in single.keys()}
    raise CheckpointError(
        f"{hf_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found; save the checkpoint with "
        "safetensors (transformers save_pretrained(..., safe_serialization=True))."
    )


def check_files(hf_dir) -> None:
    """CheckpointError naming the first weight file of `hf_dir` (the index, a shard) that is
    missing, unreadable, not safetensors or truncated. Reads the headers only, so config
    validation can refuse the directory before a run writes anything."""
    _open_checkpoint(Path(hf_dir))


def _first(names: set[str]) -> str:
    extra = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"'{sorted(names)[0]}'{extra}"


def load_tensors(
    cfg: ModelConfig, read: Mapping[str, Callable[[], np.ndarray]], *, source: str, shardings=None
) -> Transformer:
    """Builds a Transformer from HF-named tensors, reading and converting one tensor at a time.

    read: HF tensor name -> zero-argument function returning the HF-layout numpy array.
    shardings: optional pytree like `nnx.state(model, nnx.Param)` with a jax Sharding per leaf;
      each tensor is placed directly with it (never assembled on one device).
    """
    maps = tensor_maps(cfg)
    expected = {m.hf_name for m in maps}
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    available = set(read)
    missing = expected - available
    if missing:
        raise CheckpointError(
            f"{source}: missing tensor {_first(missing)} required by config.json "
            f"({cfg.architecture}, {cfg.num_layers} layers); use weights that match the config."
        )
    unexpected = {x for x in available - expected - optional if not x.endswith(_IGNORED_SUFFIXES)}
    if unexpected:
        raise CheckpointError(
            f"{source}: unexpected tensor {_first(unexpected)} for a {cfg.architecture} model "
            "with this config.json; check num_hidden_layers / tie_word_embeddings / bias fields."
        )
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = dict(nnx.to_flat_state(state))
    target = None if shardings is None else dict(nnx.to_flat_state(shardings))
    # A parameter stacked over layers (scan_layers) and / or experts is assembled from its
    # tensors, read parameter by parameter, so the host holds one stacked parameter at a time.
    stacked: dict[tuple, np.ndarray] = {}
    filled: dict[tuple, int] = {}
    for m in _in_state_order(cfg, maps):
        arr = read[m.hf_name]()
        if tuple(arr.shape) != m.hf_shape:
            raise CheckpointError(
                f"{source}: tensor '{m.hf_name}' has shape {tuple(arr.shape)} but config.json "
                f"implies {m.hf_shape}; the config does not match the weights."
            )
        value = np.asarray(m.to_model(arr)).astype(cfg.param_dtype)
        path, index = state_path(cfg, m)
        if index:
            whole = flat[path].get_value().shape
            if path not in stacked:
                stacked[path] = np.empty(whole, value.dtype)
            stacked[path][index] = value
            filled[path] = filled.get(path, 0) + 1
            if filled[path] < math.prod(whole[: len(index)]):
                continue
            value = stacked.pop(path)
        if target is None:
            placed = jnp.asarray(value)
        else:
            sharding = target[path]
            sharding = sharding.get_value() if isinstance(sharding, nnx.Variable) else sharding
            placed = jax.device_put(value, sharding)
        flat[path] = flat[path].replace(placed)
    return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))


def state_path(cfg: ModelConfig, m: TensorMap) -> tuple[tuple, tuple[int, ...]]:
    """(the model state's path of a tensor's parameter, the tensor's index within it: () for a
    whole parameter): with `scan_layers` the blocks' parameters are stacked [L, ...] under
    ('layers', ...), and an expert's tensor is slice [e] of its [E, ...] parameter."""
    path, index = m.path, ()
    if cfg.scan_layers and path[0] == "layers":
        path, index = ("layers", *path[2:]), (path[1],)
    if m.expert is not None:
        index += (m.expert,)
    return path, index


def _in_state_order(cfg: ModelConfig, maps: list[TensorMap]) -> list[TensorMap]:
    """The maps sorted so that each stacked parameter's tensors come together."""
    if not cfg.scan_layers and not cfg.moe:
        return maps
    return sorted(maps, key=lambda m: state_path(cfg, m))


def hf_model_config(
    hf_dir, param_dtype: str = "float32", compute_dtype: str = "float32"
) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory (reads only config.json): its shapes, to
    check a run and compute shardings before any weight is read."""
    return config_from_hf(
        read_hf_config(hf_dir),  # CheckpointError: missing, unreadable, not JSON
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        source=str(Path(hf_dir) / "config.json"),
    )


def from_pretrained(
    hf_dir,
    param_dtype="float32",
    compute_dtype="float32",
    *,
    remat: bool = False,
    scan_layers: bool = False,
    shardings=None,
):
    """Loads a Qwen2/Qwen2.5/Qwen3/Llama HF checkpoint directory (config.json + *.safetensors).

    param_dtype: storage dtype ('float32' or 'bfloat16'); tensors are cast to it on load.
    compute_dtype: dtype the forward pass runs in (see `ModelConfig`).
    Reads safetensors lazily, tensor by tensor, single-file or sharded with an index.
    shardings: optional, as `load_tensors`'s: every tensor placed straight into its shards
      (multi-host: every process reads the same files and keeps its addressable shards).
    Raises CheckpointError naming the file/tensor/field on any mismatch.
    """
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(
            f"{config_path} not found; pass a Hugging Face checkpoint directory with config.json "
            "and *.safetensors."
        )
    try:
        hf_config = json.loads(config_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e}); fix the file.") from e
    cfg = config_from_hf(
        hf_config, param_dtype=param_dtype, compute_dtype=compute_dtype, source=str(config_path)
    )
    cfg = cfg.replace(remat=remat, scan_layers=scan_layers)
    files = _open_checkpoint(hf_dir)
    read = {name: (lambda name=name, f=f: f.read(name)) for name, f in files.items()}
    return load_tensors(cfg, read, source=str(hf_dir), shardings=shardings)


def save_pretrained(
    model: Transformer,
    out_dir,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 4 * 2**30,
    tokenizer=None,
) -> Path:
    """Writes config.json + model.safetensors (or shards + index) that transformers loads.

    Tensors are fetched and converted one at a time to `dtype` ('float32' or 'bfloat16'; default
    the model's param dtype), which config.json records as the checkpoint's dtype.
    Models larger than max_shard_bytes are split into model-0000i-of-0000n.safetensors files
    with model.safetensors.index.json, as transformers does. Optionally saves a tokenizer.
    """
    cfg = model.config
    if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):  # would silently write the base alone
        raise ValueError(
            "save_pretrained got a model with LoRA adapters; save models.lora.merged(model) "
            "(and models.lora.save_peft for the adapters alone)."
        )
    out_dir = Path(out_dir)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    dtype_name = str(jnp.dtype(dtype or cfg.param_dtype))
    if dtype_name not in ("float32", "bfloat16"):
        raise ValueError(f"save_pretrained: dtype={dtype!r}; use 'float32' or 'bfloat16'.")
    dtype = np.dtype(jnp.dtype(dtype_name))
    sources, fetched = [], {}

    def fetch(path):  # one stacked parameter on the host at a time
        if path not in fetched:
            fetched.clear()
            fetched[path] = np.asarray(jax.device_get(flat[path].get_value()))
        return fetched[path]

    for m in _in_state_order(cfg, tensor_maps(cfg)):
        path, index = state_path(cfg, m)
        produce = lambda m=m, path=path, index=index: m.to_hf(fetch(path)[index])
        sources.append((m.hf_name, m.hf_shape, dtype, produce))
    shards, current, current_bytes = [], [], 0
    for src in sources:
        nbytes = math.prod(src[1]) * dtype.itemsize
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(src)
        current_bytes += nbytes
    shards.append(current)
    try:  # a full disk or a read-only directory: the machine's fault, in one sentence
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_FILE]:
            stale.unlink(missing_ok=True)  # never leave shards of an older export behind
        (out_dir / "config.json").write_text(
            json.dumps(config_to_hf(cfg, dtype_name), indent=2) + "\n"
        )
        if len(shards) == 1:
            safetensors_io.write_file(out_dir / SINGLE_FILE, shards[0])
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                total += safetensors_io.write_file(out_dir / name, shard)
                weight_map.update({src[0]: name for src in shard})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out_dir))
    except OSError as e:
        raise safetensors_io.write_error(e.filename or out_dir, e) from e
    return out_dir
