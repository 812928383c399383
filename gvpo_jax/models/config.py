"""Model configuration: one frozen dataclass for Qwen2/Qwen2.5, Qwen3, Llama and Gemma 3 (text),
named presets, HF I/O."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from gvpo_jax.errors import BadInputError

ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# transformers' model_type of each architecture (Gemma 3's text-only model is "gemma3_text").
HF_MODEL_TYPES = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "llama": "llama",
    "gemma3": "gemma3_text",
    "qwen3_moe": "qwen3_moe",
}
LAYER_TYPES = ("full", "sliding")
# Widths and counts of a ModelConfig: each a positive integer.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)


class CheckpointError(BadInputError):
    """A checkpoint or its config is unusable; the message names the file/tensor/field and fix."""


ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "blocked", "xla", "splash")
# How an MoE layer sends tokens to their experts (models/moe.py): auto picks ragged_dot on TPU
# and GPU and the grouped path on CPU; dense runs every expert on every token (the reference).
MOE_DISPATCH = ("auto", "dense", "grouped", "ragged")


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

    Gemma 3 (`architecture="gemma3"`) adds, on top of QK-norm: embeddings scaled by
    sqrt(hidden_size); RMSNorm in the (1 + weight) form (zero-initialised weights); a norm after
    attention and after the MLP as well as before each; a GeGLU MLP (gelu with the tanh
    approximation); scores scaled by `query_pre_attn_scalar`^-1/2 instead of head_dim^-1/2;
    and `layer_types`, one of "sliding" / "full" per layer: a sliding layer's query sees only
    the last `sliding_window` positions (itself included) and rotates with base
    `rope_local_theta`, a full layer with `rope_theta` (positions divided by `rope_scaling`,
    transformers' "linear" RoPE scaling of Gemma 3's 4B+ models).
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
    scan_layers: bool = False  # blocks stacked [L, ...] and run by one scan (flat compile time)
    # With scan_layers, the sampler scans too; False: it slices the stacked blocks once per call
    # and runs them unrolled (`unstacked`), XLA CPU's fast decode (its scan copies each layer's
    # weights at every decode step).
    scan_decode: bool = True
    attention: str = "auto"  # auto | dense | blocked | xla | splash (see models/attention.py)
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Gemma 3 (see the class docstring); the defaults are every other family's.
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding"; () = all full
    sliding_window: int = 0  # keys a sliding layer's query sees (itself included)
    rope_local_theta: float = 10000.0  # RoPE base of sliding layers
    rope_scaling: float = 1.0  # linear RoPE scaling factor of full layers
    query_pre_attn_scalar: int = 0  # scores scaled by this^-1/2; 0 = head_dim
    # Mixture of experts (Qwen3-MoE; models/moe.py): num_experts > 0 makes layer i an MoE layer
    # when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (transformers'
    # rule); the others keep the dense MLP of intermediate_size. Each token goes to the
    # num_experts_per_tok experts of highest router probability (softmax in fp32), weighted
    # by those probabilities (renormalised to sum 1 with norm_topk_prob). Dropless: no capacity.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    moe_dispatch: str = "auto"  # auto | dense | grouped | ragged (MOE_DISPATCH)
    moe_block: int = 64  # the grouped path's rows per block (each block one expert's tokens)

    def __post_init__(self):
        for name in SHAPE_FIELDS:  # a zero width divides by zero or builds empty arrays later
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r}; use a positive integer.")
        for name in ("sliding_window", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name}={value!r}; use an integer >= 0 (0: off).")
        for name in ("rope_theta", "rope_local_theta", "rms_norm_eps", "rope_scaling"):
            value = getattr(self, name)
            positive = name != "rms_norm_eps"
            if (
                not isinstance(value, numbers.Real)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < 0
                or (positive and value == 0)
            ):
                bound = "a finite number > 0" if positive else "a finite number >= 0"
                raise ValueError(f"ModelConfig.{name}={value!r}; use {bound}.")
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
        if self.architecture == "gemma3" and (not self.qk_norm or self.attention_bias):
            raise ValueError(
                "ModelConfig.architecture='gemma3' needs qk_norm=True and attention_bias=False "
                "(Gemma 3 normalises q and k per head and has no projection biases)."
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(
                    f"ModelConfig.layer_types={self.layer_types!r}; give one of "
                    f"{LAYER_TYPES} for each of the {self.num_layers} layers, or () for all full."
                )
            if "sliding" in self.layer_types and self.sliding_window < 1:
                raise ValueError(
                    "ModelConfig.layer_types has sliding layers but sliding_window is "
                    f"{self.sliding_window}; set the window (e.g. 512)."
                )
            if self.architecture != "gemma3" and "sliding" in self.layer_types:
                raise ValueError(
                    f"ModelConfig: sliding layers need architecture='gemma3' "
                    f"(got {self.architecture!r})."
                )
        if self.rope_scaling < 1.0:
            raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling}; use a factor >= 1.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention); use a "
                "num_kv_heads that divides num_heads."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} must be even for RoPE; use an even width."
            )
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"ModelConfig.attention={self.attention!r}; use one of "
                f"{', '.join(ATTENTION_IMPLEMENTATIONS)}."
            )
        self._check_moe()
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r}; use 'float32' or 'bfloat16'."
                )

    def _check_moe(self) -> None:
        """The mixture-of-experts fields: all off (num_experts 0) or a model they can build."""
        if self.architecture == "qwen3_moe" and (not self.qk_norm or self.attention_bias):
            raise ValueError(
                "ModelConfig.architecture='qwen3_moe' needs qk_norm=True and "
                "attention_bias=False (Qwen3-MoE attends as Qwen3 does); set both."
            )
        if self.moe_dispatch not in MOE_DISPATCH:
            raise ValueError(
                f"ModelConfig.moe_dispatch={self.moe_dispatch!r}; use one of "
                f"{', '.join(MOE_DISPATCH)}."
            )
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name}={value!r}; use an integer >= 0.")
        for name in ("decoder_sparse_step", "moe_block"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r}; use a positive integer.")
        if not self.num_experts:
            if self.architecture == "qwen3_moe":
                raise ValueError(
                    "ModelConfig.architecture='qwen3_moe' has num_experts=0; set the experts "
                    "(e.g. num_experts=8, num_experts_per_tok=2, moe_intermediate_size=...)."
                )
            return
        if self.architecture != "qwen3_moe":
            raise ValueError(
                f"ModelConfig.num_experts={self.num_experts} with architecture="
                f"{self.architecture!r}; experts need architecture='qwen3_moe'."
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} with "
                f"num_experts={self.num_experts}; route each token to between 1 and "
                f"{self.num_experts} experts."
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(
                "ModelConfig.moe_intermediate_size is 0; set each expert's MLP width (Qwen3-MoE "
                "30B-A3B: 768)."
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.mlp_only_layers)) != len(self.mlp_only_layers):
            raise ValueError(
                f"ModelConfig.mlp_only_layers={self.mlp_only_layers!r}; list distinct layer "
                f"indices in [0, {self.num_layers})."
            )
        if not any(self.moe_layer(i) for i in range(self.num_layers)):
            raise ValueError(
                "ModelConfig: num_experts > 0 but decoder_sparse_step / mlp_only_layers leave "
                "no MoE layer; set num_experts=0 for a dense model or route some layers."
            )
        if self.scan_layers and not self.scannable:
            raise ValueError(
                "ModelConfig.scan_layers=True with both dense and MoE layers "
                f"(decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                f"{self.mlp_only_layers}): the scan runs one kind of layer; set "
                "scan_layers=False for this layer pattern."
            )

    def moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes through experts (transformers' Qwen3-MoE rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def scannable(self) -> bool:
        """Every layer has the same kind of MLP (all dense or all MoE), as one scan needs."""
        return len({self.moe_layer(i) for i in range(self.num_layers)}) == 1

    @property
    def moe(self) -> bool:
        """Some layer routes through experts."""
        return self.num_experts > 0

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def gemma(self) -> bool:
        """Gemma 3's block: (1 + w) norms, sandwich norms, GeGLU, scaled embeddings."""
        return self.architecture == "gemma3"

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full causal attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding":
            return self.sliding_window
        return None

    def rope(self, layer: int) -> tuple[float, float]:
        """(base, linear scaling factor) of layer `layer`'s rotary embedding."""
        if self.window(layer) is not None:
            return self.rope_local_theta, 1.0
        return self.rope_theta, self.rope_scaling

    def score_scale(self) -> float:
        """What attention scores are multiplied by: query_pre_attn_scalar^-1/2 (Gemma 3) or
        head_dim^-1/2."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


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


def _qwen3_moe(hidden, inter, layers, heads, kv, experts, top_k, expert_inter) -> ModelConfig:
    """Qwen3-MoE: Qwen3's attention (QK-norm, head_dim 128), every layer an MoE layer of
    `experts` SwiGLU experts, top-`top_k` routing renormalised (norm_topk_prob), untied."""
    return _qwen3(hidden, inter, layers, heads, False).replace(
        num_kv_heads=kv,
        architecture="qwen3_moe",
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_inter,
        norm_topk_prob=True,
    )


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's layout: every `pattern`-th layer full, the others sliding (5:1)."""
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


def _gemma3(vocab, hidden, inter, layers, heads, kv, window, scaling, max_pos) -> ModelConfig:
    """Gemma 3 text: head_dim 256, QK-norm, 5 sliding layers (RoPE base 1e4) per full layer
    (base 1e6), tied embeddings, bos 2, eos 1 (<eos>; the instruction-tuned models end turns
    with 106, <end_of_turn>), pad 0."""
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=256,
        intermediate_size=inter,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        architecture="gemma3",
        max_position_embeddings=max_pos,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        layer_types=gemma3_layer_types(layers),
        sliding_window=window,
        rope_local_theta=1e4,
        rope_scaling=scaling,
        query_pre_attn_scalar=256,
    )


# Shapes copied from the published config.json files (Qwen/*, HuggingFaceTB/SmolLM2-135M,
# google/gemma-3-*).
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
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 48, 32, 4, 128, 8, 768),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 94, 64, 4, 128, 8, 1536),
    "gemma3-270m": _gemma3(262144, 640, 2048, 18, 4, 1, 512, 1.0, 32768),
    "gemma3-1b": _gemma3(262144, 1152, 6912, 26, 4, 1, 512, 1.0, 32768),
    "gemma3-4b": _gemma3(262208, 2560, 10240, 34, 8, 4, 1024, 8.0, 131072),
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
    # Unit-test MoE: Qwen3-MoE at tiny's size, every layer 8 experts of width 32, top-2.
    "tiny-moe": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        architecture="qwen3_moe",
        max_position_embeddings=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}


def read_hf_config(hf_dir) -> dict:
    """The config.json of a Hugging Face directory as a dict; CheckpointError (one sentence
    naming the file) when it is missing, unreadable, not JSON or not a JSON object."""
    path = Path(hf_dir) / "config.json"
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise CheckpointError(
            f"{path} not found; point model.hf_dir at a Hugging Face checkpoint directory "
            "(config.json and *.safetensors)."
        ) from e
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CheckpointError(
            f"{path} cannot be read ({reason}); make it a readable UTF-8 text file."
        ) from e
    try:
        hf = json.loads(text)
    except ValueError as e:
        where = (
            f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        )
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise CheckpointError(
            f"{path} is not valid JSON ({reason}{where}); fix it or download it again."
        ) from e
    if not isinstance(hf, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(hf).__name__}, not an object of model fields; use the "
            "model's own config.json."
        )
    return hf


def _field(hf: dict, name: str, source: str) -> Any:
    if name not in hf or hf[name] is None:
        raise CheckpointError(f"{source}: required field '{name}' is missing; add it to the file.")
    return hf[name]


def _count(hf: dict, name: str, source: str, default: int | None = None) -> int:
    """A width or count of config.json: a positive integer (`default` when absent or null; a
    required field without one)."""
    if hf.get(name) is None and default is not None:
        return default
    value = _field(hf, name, source)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
        or value < 1
    ):
        raise CheckpointError(
            f"{source}: '{name}' is {value!r}; set the model's positive integer (as in its "
            "published config.json)."
        )
    return int(value)


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
    """Builds a ModelConfig from a Hugging Face config.json dict (Qwen2, Qwen3, Llama or Gemma 3).

    Raises CheckpointError naming the field for unsupported architectures or options, and naming
    the file for a field of the wrong JSON type.
    """
    if not isinstance(hf, dict):
        raise CheckpointError(
            f"{source} holds a JSON {type(hf).__name__}, not an object of model fields; use the "
            "model's own config.json."
        )
    try:
        return _config_from_hf(hf, param_dtype, compute_dtype, source)
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
        # A field of the wrong JSON type: a string for a number, a list for an object, ...
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else ""
        raise CheckpointError(
            f"{source} has a field of the wrong type ({type(e).__name__}: {reason}); compare it "
            "with the model's published config.json."
        ) from e


def _config_from_hf(hf: dict, param_dtype: str, compute_dtype: str, source: str) -> ModelConfig:
    """`config_from_hf` of a dict."""
    model_type = hf.get("model_type")
    by_type = {v: k for k, v in HF_MODEL_TYPES.items()}
    if model_type not in by_type:
        archs = hf.get("architectures")
        raise CheckpointError(
            f"{source}: model_type={model_type!r} (architectures={archs}) is not supported; "
            f"use a checkpoint of model_type in {sorted(by_type)}."
        )
    if model_type == "gemma3_text":
        return _gemma3_from_hf(hf, param_dtype, compute_dtype, source)
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
    if model_type == "llama" and hf.get("attention_bias", False):
        raise CheckpointError(
            f"{source}: attention_bias=true is not supported for llama (its o_proj has a bias "
            "this model lacks); only bias-free Llama attention, as in the published checkpoints."
        )
    if model_type in ("qwen3", "qwen3_moe") and hf.get("attention_bias", False):
        raise CheckpointError(
            f"{source}: attention_bias=true is not supported for {model_type} (its o_proj would "
            "have a bias too); only bias-free Qwen3 attention, as in the published checkpoints."
        )
    moe = _moe_from_hf(hf, source) if model_type == "qwen3_moe" else {}
    hidden = _count(hf, "hidden_size", source)
    heads = _count(hf, "num_attention_heads", source)
    kv = _count(hf, "num_key_value_heads", source, default=heads)
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(eos)
    try:
        return ModelConfig(
            vocab_size=_count(hf, "vocab_size", source),
            hidden_size=hidden,
            num_layers=_count(hf, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=_count(hf, "head_dim", source, default=hidden // heads),
            intermediate_size=_count(hf, "intermediate_size", source),
            rope_theta=_rope_theta(hf, source),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            # transformers 5 defaults both Qwen2Config and LlamaConfig to untied embeddings.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases in transformers; Llama reads `attention_bias`;
            # Qwen3 has none (refused above).
            attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            architecture=model_type,
            param_dtype=str(jnp.dtype(param_dtype)),
            compute_dtype=str(jnp.dtype(compute_dtype)),
            max_position_embeddings=_count(hf, "max_position_embeddings", source, default=32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
            **moe,
        )
    except ValueError as e:  # ModelConfig's own checks: re-raise as a checkpoint problem
        raise CheckpointError(f"{source}: {e}") from e


def _moe_from_hf(hf: dict, source: str) -> dict:
    """ModelConfig's mixture-of-experts fields of a Qwen3MoeConfig dict (transformers' defaults
    where a field is absent). Routing is always dropless here: a config asking for capacity
    or a router the model does not implement is refused."""
    for key in ("capacity_factor", "expert_capacity", "moe_capacity_factor"):
        if hf.get(key):
            raise CheckpointError(
                f"{source}: {key}={hf[key]} asks for capacity-limited routing; this model is "
                f"dropless (a dropped token would change its log-prob), remove {key}."
            )
    for key in ("num_shared_experts", "shared_expert_intermediate_size", "n_shared_experts"):
        if hf.get(key):
            raise CheckpointError(
                f"{source}: {key}={hf[key]} (shared experts) is not part of Qwen3-MoE; use a "
                "Qwen3-MoE checkpoint without them."
            )
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError(
            f"{source}: mlp_only_layers is {only!r}; give a list of layer indices (or [])."
        )
    return {
        # the published configs' name; transformers 5 writes it as num_local_experts
        "num_experts": _count(
            hf, "num_experts" if "num_experts" in hf else "num_local_experts", source, default=128
        ),
        "num_experts_per_tok": _count(hf, "num_experts_per_tok", source, default=8),
        "moe_intermediate_size": _count(hf, "moe_intermediate_size", source, default=768),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": _count(hf, "decoder_sparse_step", source, default=1),
        "mlp_only_layers": tuple(only),
    }


def _gemma3_from_hf(hf: dict, param_dtype: str, compute_dtype: str, source: str) -> ModelConfig:
    """ModelConfig of a transformers Gemma3TextConfig dict (transformers 5's `rope_parameters`
    per layer type, or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`)."""
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(
            f"{source}: hidden_activation={act!r} is not supported for Gemma 3; only "
            "'gelu_pytorch_tanh'."
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise CheckpointError(
                f"{source}: {key}={hf[key]} is not supported (Gemma 3 has none); set it to null."
            )
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"{source}: use_bidirectional_attention=true is not supported; causal models only."
        )
    layers = _count(hf, "num_hidden_layers", source)
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    raw_types = hf.get("layer_types")
    if raw_types is None:
        types = gemma3_layer_types(layers, int(hf.get("sliding_window_pattern", 6)))
    elif set(raw_types) - set(names) or len(raw_types) != layers:
        raise CheckpointError(
            f"{source}: layer_types {raw_types} is not one of sliding_attention / full_attention "
            f"per layer for {layers} layers."
        )
    else:
        types = tuple(names[t] for t in raw_types)
    rope = hf.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    if not full and hf.get("rope_scaling"):
        full = dict(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 1e4))
    factor = 1.0
    for part, params in (("full_attention", full), ("sliding_attention", local)):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "linear" and part == "full_attention":
            factor = float(params.get("factor", 1.0))
        elif kind != "default":
            raise CheckpointError(
                f"{source}: rope type {kind!r} of {part} layers is not supported; Gemma 3 uses "
                "the default RoPE (sliding) and default or linear (full)."
            )
    hidden = _count(hf, "hidden_size", source)
    heads = _count(hf, "num_attention_heads", source)
    eos = hf.get("eos_token_id")
    try:
        return ModelConfig(
            vocab_size=_count(hf, "vocab_size", source),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_count(hf, "num_key_value_heads", source, default=heads),
            head_dim=_count(hf, "head_dim", source, default=256),
            intermediate_size=_count(hf, "intermediate_size", source),
            rope_theta=float(full["rope_theta"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            attention_bias=bool(hf.get("attention_bias", False)),
            qk_norm=True,
            architecture="gemma3",
            param_dtype=str(jnp.dtype(param_dtype)),
            compute_dtype=str(jnp.dtype(compute_dtype)),
            max_position_embeddings=_count(hf, "max_position_embeddings", source, default=131072),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            layer_types=types,
            sliding_window=int(hf.get("sliding_window") or 0),
            rope_local_theta=float(local["rope_theta"]),
            rope_scaling=factor,
            query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar", 256)),
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from e


def _gemma3_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    """Gemma3TextConfig fields on top of the common ones of `config_to_hf`."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != 1.0:
        full = {"rope_type": "linear", "factor": cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    names = {"sliding": "sliding_attention", "full": "full_attention"}
    types = cfg.layer_types or ("full",) * cfg.num_layers
    hf = {k: v for k, v in hf.items() if k not in ("hidden_act", "rope_theta")}
    hf.update(
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        layer_types=[names[t] for t in types],
        sliding_window=cfg.sliding_window or None,
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        },
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    return hf


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
    if cfg.architecture == "llama" and cfg.attention_bias:
        raise CheckpointError(
            "ModelConfig: a llama model with attention_bias has no transformers equivalent "
            "(transformers' Llama biases o_proj as well); use architecture='qwen2' for q/k/v "
            "biases only."
        )
    if cfg.qk_norm and cfg.architecture not in ("qwen3", "gemma3", "qwen3_moe"):
        raise CheckpointError(
            f"ModelConfig: a {cfg.architecture} model with qk_norm has no transformers "
            "equivalent; use architecture='qwen3' (with attention_bias=False) for QK-norm."
        )
    hf = {
        "architectures": [ARCHITECTURES[cfg.architecture]],
        "model_type": HF_MODEL_TYPES[cfg.architecture],
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
    if cfg.architecture == "gemma3":
        return _gemma3_to_hf(cfg, hf)
    if cfg.architecture == "llama":
        hf.update(attention_bias=cfg.attention_bias, mlp_bias=False)
    elif cfg.architecture == "qwen3":
        hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    elif cfg.architecture == "qwen3_moe":
        hf.update(
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            output_router_logits=False,
            router_aux_loss_coef=0.001,  # transformers' default; read only when training
        )
    else:
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf
