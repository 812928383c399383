"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama) in Flax NNX with HF and GGUF import,
HF export.

`transformer` is the model, `cache` its typed KV caches and the attention that reads them,
`attention` the kernels, `remat` the per-block rematerialisation.
"""

from gvpo_jax.models.attention import attention_mask
from gvpo_jax.models.cache import (
    CACHE_AXES,
    DECODE_CACHE_AXES,
    KVCache,
    PackedPrefixCache,
    SharedPrefixCache,
    SlotCache,
)
from gvpo_jax.models.config import (
    ARCHITECTURES,
    PRESETS,
    CheckpointError,
    ModelConfig,
    config_from_hf,
    config_to_hf,
)
from gvpo_jax.models.gguf_io import from_gguf, gguf_config, gguf_tokenizer
from gvpo_jax.models.hf import from_pretrained, hf_model_config, save_pretrained, tensor_maps
from gvpo_jax.models.logprobs import chunked_logprobs, naive_logprobs, token_logprobs
from gvpo_jax.models.transformer import (
    ACTIVATION_AXES,
    PARAM_AXES,
    KeyStream,
    Transformer,
    abstract_model,
    cast_floating,
    default_positions,
    param_count,
    unstacked,
    with_compute_dtype,
    with_config,
)

__all__ = [
    "ACTIVATION_AXES",
    "ARCHITECTURES",
    "CACHE_AXES",
    "DECODE_CACHE_AXES",
    "PARAM_AXES",
    "PRESETS",
    "CheckpointError",
    "KeyStream",
    "KVCache",
    "ModelConfig",
    "PackedPrefixCache",
    "SharedPrefixCache",
    "SlotCache",
    "Transformer",
    "abstract_model",
    "attention_mask",
    "chunked_logprobs",
    "config_from_hf",
    "config_to_hf",
    "default_positions",
    "from_gguf",
    "gguf_config",
    "gguf_tokenizer",
    "from_pretrained",
    "hf_model_config",
    "naive_logprobs",
    "param_count",
    "save_pretrained",
    "tensor_maps",
    "token_logprobs",
    "unstacked",
    "with_compute_dtype",
    "cast_floating",
    "with_config",
]
