"""Model configuration: one frozen dataclass for Qwen2/Qwen2.5, Qwen3 and Llama, named presets,
HF I/O."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from gvpo_jax.errors import BadInputError

ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}


class CheckpointError(BadInputError):
    """A checkpoint or its config is unusable; the message names the file/tensor/field and fix."""


ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "blocked", "xla", "splash")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer (pre-norm, GQA, RoPE, SwiGLU).

    `head_dim` may differ from hidden_size // num_heads (explicit in Llama and Qwen3 configs).
    `qk_norm` (Qwen3) RMS-normalises each head of q and k over head_dim, with its own learned
    scale of size head_dim for q and for k, after the projection and before RoPE.
    `param_dtype` stores the parameters (the fp32 masters a trainer updates); `compute_dtype` is
    what the forward pass runs in: each weight is cast to it where it is used (inside the compiled
    graph, so gradients flow back to the masters in `param_dtype`), and activations and the KV
    cache are kept in it. Logits, log-softmax and the losses are always fp32.
    `attention` picks the kernel for sequences of more than one query token (models/attention.py;
    `auto`: splash on TPU, XLA's / cuDNN's on GPU, blocked or dense on CPU by size).
    `remat=True` recomputes each layer in the backward pass, after the cotangent of its output
    (activation memory O(layers * B*T*D) plus one layer's recomputation).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = True
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    architecture: str = "qwen2"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False
    attention: str = "auto"  # auto | dense | blocked | xla | splash (see models/attention.py)
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture={self.architecture!r} is not supported; "
                f"use one of {sorted(ARCHITECTURES)}."
            )
        if self.architecture == "qwen3" and (not self.qk_norm or self.attention_bias):
            raise ValueError(
                f"ModelConfig.architecture='qwen3' needs qk_norm=True and attention_bias=False "
                f"(got qk_norm={self.qk_norm}, attention_bias={self.attention_bias}); set both "
                "(Qwen3 normalises q and k per head and has no q/k/v bias)."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE.")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"ModelConfig.attention={self.attention!r}; use one of "
                f"{', '.join(ATTENTION_IMPLEMENTATIONS)}."
            )
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r}; use 'float32' or 'bfloat16'."
                )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _qwen(vocab, hidden, inter, layers, heads, kv, theta, tied, max_pos, eos) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        intermediate_size=inter,
        rope_theta=theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attention_bias=True,
        architecture="qwen2",
        max_position_embeddings=max_pos,
        bos_token_id=151643,
        eos_token_id=eos,
    )


def _qwen3(hidden, inter, layers, heads, tied) -> ModelConfig:
    """Qwen3 dense: QK-norm, no bias, head_dim 128 (not hidden // heads), 8 KV heads."""
    return ModelConfig(
        vocab_size=151936,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=inter,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attention_bias=False,
        qk_norm=True,
        architecture="qwen3",
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,  # <|im_end|> (the post-trained models; *-Base use 151643)
    )


# Shapes copied from the published config.json files (Qwen/*, HuggingFaceTB/SmolLM2-135M).
PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen(151936, 896, 4864, 24, 14, 2, 1e6, True, 32768, 151643),
    "qwen2.5-1.5b": _qwen(151936, 1536, 8960, 28, 12, 2, 1e6, True, 32768, 151643),
    "qwen2.5-7b": _qwen(152064, 3584, 18944, 28, 28, 4, 1e6, False, 131072, 151643),
    "qwen2.5-math-1.5b": _qwen(151936, 1536, 8960, 28, 12, 2, 1e4, True, 4096, 151643),
    "qwen2.5-math-7b": _qwen(152064, 3584, 18944, 28, 28, 4, 1e4, False, 4096, 151643),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        architecture="llama",
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Benchmark model, Qwen2 layout: 39.3M parameters (tied embedding 16.8M + 8 layers x 2.8M).
    "bench-45m": ModelConfig(
        vocab_size=32768,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=True,
        architecture="qwen2",
        max_position_embeddings=4096,
    ),
    # Unit-test model: every feature (GQA, bias, tying) at a size that compiles in seconds.
    "tiny": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=True,
        architecture="qwen2",
        max_position_embeddings=2048,
    ),
}


def _field(hf: dict, name: str, source: str) -> Any:
    if name not in hf or hf[name] is None:
        raise CheckpointError(f"{source}: required field '{name}' is missing; add it to the file.")
    return hf[name]


def _rope_theta(hf: dict, source: str) -> float:
    """RoPE base from either layout: transformers 5 `rope_parameters` or top-level `rope_theta`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    if params is not None:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(
                f"{source}: rope type {rope_type!r} in 'rope_parameters' is not supported; "
                "only the default (unscaled) RoPE is implemented."
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    return 10000.0  # transformers' default when neither layout gives a base


def config_from_hf(
    hf: dict,
    *,
    param_dtype: str = "float32",
    compute_dtype: str = "float32",
    source: str = "config.json",
) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json dict (Qwen2, Qwen3 or Llama family).

    Raises CheckpointError naming the field for unsupported architectures or options.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        archs = hf.get("architectures")
        raise CheckpointError(
            f"{source}: model_type={model_type!r} (architectures={archs}) is not supported; "
            f"use a checkpoint of model_type in {sorted(ARCHITECTURES)}."
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act={act!r} is not supported; only 'silu'.")
    if hf.get("mlp_bias", False):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported; only bias-free MLPs.")
    if hf.get("use_sliding_window", False):
        raise CheckpointError(
            f"{source}: use_sliding_window=true is not supported; set it to false "
            "(full causal attention)."
        )
    layer_types = set(hf.get("layer_types") or ())
    if layer_types - {"full_attention"}:
        raise CheckpointError(
            f"{source}: layer_types {sorted(layer_types)} is not supported; only "
            "'full_attention' layers (no sliding window)."
        )
    if model_type == "qwen3" and hf.get("attention_bias", False):
        raise CheckpointError(
            f"{source}: attention_bias=true is not supported for qwen3 (its o_proj would have a "
            "bias too); only bias-free Qwen3 attention, as in the published checkpoints."
        )
    hidden = int(_field(hf, "hidden_size", source))
    heads = int(_field(hf, "num_attention_heads", source))
    kv = hf.get("num_key_value_heads") or heads
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(eos)
    try:
        return ModelConfig(
            vocab_size=int(_field(hf, "vocab_size", source)),
            hidden_size=hidden,
            num_layers=int(_field(hf, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=int(kv),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(_field(hf, "intermediate_size", source)),
            rope_theta=_rope_theta(hf, source),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            # transformers 5 defaults both Qwen2Config and LlamaConfig to untied embeddings.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases in transformers; Llama reads `attention_bias`;
            # Qwen3 has none (refused above).
            attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            architecture=model_type,
            param_dtype=str(jnp.dtype(param_dtype)),
            compute_dtype=str(jnp.dtype(compute_dtype)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
        )
    except ValueError as e:  # ModelConfig's own checks: re-raise as a checkpoint problem
        raise CheckpointError(f"{source}: {e}") from e


def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict:
    """The config.json dict that transformers 5 loads as Qwen2ForCausalLM / Qwen3ForCausalLM /
    LlamaForCausalLM.

    `dtype` is the dtype the tensors are written in (default: `cfg.param_dtype`).
    """
    if cfg.architecture == "qwen2" and not cfg.attention_bias:
        raise CheckpointError(
            "ModelConfig: a qwen2 model without attention_bias has no transformers equivalent; "
            "use architecture='llama' for bias-free attention."
        )
    if cfg.qk_norm and cfg.architecture != "qwen3":
        raise CheckpointError(
            f"ModelConfig: a {cfg.architecture} model with qk_norm has no transformers "
            "equivalent; use architecture='qwen3' (with attention_bias=False) for QK-norm."
        )
    hf = {
        "architectures": [ARCHITECTURES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,  # older transformers read this key
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id)
        if isinstance(cfg.eos_token_id, tuple)
        else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype or cfg.param_dtype,
        "use_cache": True,
    }
    if cfg.architecture == "llama":
        hf.update(attention_bias=cfg.attention_bias, mlp_bias=False)
    elif cfg.architecture == "qwen3":
        hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf
