"""GGUF (llama.cpp) loader: dequantise in numpy, undo the q/k permutation, map to HF names."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np

from gvpo_jax.models.config import CheckpointError, ModelConfig, gemma3_layer_types
from gvpo_jax.models.hf import load_tensors
from gvpo_jax.models.transformer import Transformer

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's QK-norm scales [head_dim]
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# Gemma 3's sandwich norms: llama.cpp calls the norm after attention post_attention_norm, the
# one before the MLP ffn_norm and the one after it post_ffw_norm.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> transformers name (None if unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def unpermute_rope(w_OxI: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Llama q/k permutation (interleaved -> rotate-half RoPE layout).

    llama.cpp stores each head's rows as (H/2, 2) pairs; transformers expects (2, H/2) halves.
    Works for weights [heads*H, D] and biases [heads*H].
    """
    half = w_OxI.shape[0] // num_heads // 2
    w = w_OxI.reshape(num_heads, half, 2, *w_OxI.shape[1:])
    return w.swapaxes(1, 2).reshape(w_OxI.shape)


class _ModelReader(gguf.GGUFReader):
    """`gguf.GGUFReader` that steps over long metadata arrays instead of parsing them.

    The library builds one numpy view per array element: 8 s for the 262,144-token vocabulary
    (tokens, scores, types) of Gemma 3, which the model does not read (the tokenizer is
    transformers' own conversion, `gguf_tokenizer`). An array of more than `LONG` elements is
    kept as its type and length only (`_stepped_over` tells it apart); everything else, the
    tensors included, is the library's own parse.
    """

    LONG = 4096

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item = gguf.GGUFValueType(int(item_type[0]))
        scalar = self.gguf_scalar_to_np.get(item)
        if int(count[0]) <= self.LONG or (scalar is None and item != gguf.GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12
        if scalar is not None:
            offs += int(np.dtype(scalar).itemsize) * int(count[0])
        else:  # strings: (u64 length, bytes) each, so walk the lengths
            view = memoryview(self.data)
            order = "big" if self.byte_order == "S" else "little"
            for _ in range(int(count[0])):
                offs += 8 + int.from_bytes(view[offs : offs + 8], order)
        return offs - orig_offs, [item_type, count], [], [gguf.GGUFValueType.ARRAY, item]


def _stepped_over(field) -> bool:
    """A non-empty array whose elements `_ModelReader` did not parse."""
    return (
        bool(field.types)
        and field.types[0] == gguf.GGUFValueType.ARRAY
        and not field.data
        and int(field.parts[-1][0]) > 0
    )


def _fields(reader: gguf.GGUFReader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "token_type", "merges")):
            continue  # large arrays, not needed for the model config
        if _stepped_over(field):
            continue  # a long array `_ModelReader` did not parse
        try:
            out[key] = field.contents()
        except (ValueError, TypeError, IndexError):
            continue
    return out


def _reason(error: BaseException) -> str:
    """An exception as a short phrase for a one-sentence message (first line, no final dot)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0].rstrip(".") if lines else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def _decimal(x) -> float:
    """GGUF stores float32: recover the shortest decimal (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _metadata(fields: dict, key: str, source: str, default=None, kind=int):
    """GGUF metadata value `key` as `kind`; CheckpointError naming the key when it is missing
    or not of that kind (the parser turns garbled bytes into values of any type)."""
    value = fields.get(key, default)
    if value is None:
        raise CheckpointError(
            f"{source}: metadata key '{key}' is missing; use a GGUF file converted by llama.cpp's "
            "convert_hf_to_gguf."
        )
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise CheckpointError(
            f"{source}: metadata key '{key}' is {str(value)[:40]!r}, not a "
            f"{'number' if kind is float else 'whole number'}; the file is damaged, re-download "
            "or re-convert it."
        ) from None


def config_from_gguf(
    fields: dict, tensor_shapes: dict, *, param_dtype: str, compute_dtype: str, source: str
):
    """ModelConfig from GGUF metadata and tensor shapes (GGUF order, innermost first).

    Raises CheckpointError naming the missing or unsupported key.
    """
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED:
        raise CheckpointError(
            f"{source}: general.architecture={arch!r} is not supported; "
            f"use a GGUF of one of {SUPPORTED}."
        )

    def get(key, default=None, kind=int):
        return _metadata(fields, f"{arch}.{key}", source, default, kind)

    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    factor = 1.0
    if arch == "gemma3" and scaling == "linear":  # Gemma 3 4B+: full layers' linear scaling
        factor = get("rope.scaling.factor", kind=float)
    elif scaling not in ("none", None):
        raise CheckpointError(
            f"{source}: '{arch}.rope.scaling.type'={scaling!r} is not supported (default RoPE)."
        )
    gemma = {}
    if arch == "gemma3":
        # llama.cpp keeps Gemma 3's 5:1 layer pattern, the local RoPE base (10000) and the
        # query scalar (head_dim for every published size but 27B) in code, not in the file.
        layers = get("block_count")
        gemma = dict(
            layer_types=gemma3_layer_types(layers),
            sliding_window=get("attention.sliding_window"),
            rope_local_theta=10000.0,
            rope_scaling=factor,
            query_pre_attn_scalar=get("attention.key_length"),
        )
    hidden, heads = get("embedding_length"), get("attention.head_count")
    if "token_embd.weight" not in tensor_shapes:
        raise CheckpointError(
            f"{source}: tensor 'token_embd.weight' is missing; use a complete GGUF file."
        )
    token_id = lambda key: None if fields.get(key) is None else _metadata(fields, key, source)
    try:
        return ModelConfig(
            vocab_size=get("vocab_size", tensor_shapes["token_embd.weight"][-1]),
            hidden_size=hidden,
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=get("attention.key_length", hidden // max(heads, 1)),
            intermediate_size=get("feed_forward_length"),
            rope_theta=_decimal(get("rope.freq_base", 10000.0, kind=float)),
            rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon", kind=float)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            qk_norm=arch in ("qwen3", "gemma3"),
            architecture=arch,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            max_position_embeddings=get("context_length", 32768),
            bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
            pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
            **gemma,
        )
    except CheckpointError:
        raise
    except ValueError as e:  # ModelConfig's own checks (e.g. a Qwen3 GGUF with q/k/v biases)
        raise CheckpointError(f"{source}: {e}") from e


def _open(path: Path, param_dtype: str, compute_dtype: str) -> tuple[ModelConfig, dict]:
    """(ModelConfig, {GGUF name: tensor}) of a GGUF file, its tensor data not read (memory
    mapped). CheckpointError names the file and the fix when it is missing, unreadable, damaged
    or of a layout this loader does not know."""
    if not path.is_file():
        raise CheckpointError(f"{path} not found; pass the path of a .gguf file.")
    try:
        reader = _ModelReader(path)
    except OSError as e:
        raise CheckpointError(
            f"{path} cannot be read ({e.strerror or e}); check that it is a readable file."
        ) from e
    except Exception as e:
        # The gguf library walks the bytes with numpy views: a garbled or truncated file fails
        # with whatever numpy raises there (IndexError, ValueError, OverflowError, MemoryError).
        raise CheckpointError(
            f"{path} is not a valid GGUF file ({_reason(e)}); re-download or re-convert it."
        ) from e
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(
        _fields(reader),
        {name: tuple(int(x) for x in t.shape) for name, t in tensors.items()},
        param_dtype=str(jnp.dtype(param_dtype)),
        compute_dtype=str(jnp.dtype(compute_dtype)),
        source=str(path),
    )
    for name in tensors:
        if hf_name(name, cfg.architecture) is None:
            raise CheckpointError(
                f"{path}: tensor '{name}' has no transformers equivalent for {cfg.architecture}; "
                "this GGUF layout is not supported."
            )
    return cfg, tensors


def gguf_config(path, param_dtype="float32", compute_dtype="float32") -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata and tensor shapes (no tensor data read;
    the trainer decides the layers' layout from it before loading). CheckpointError as
    `from_gguf`'s."""
    return _open(Path(path), param_dtype, compute_dtype)[0]


def check_file(path) -> None:
    """CheckpointError when the GGUF file `path` cannot be loaded: missing, unreadable, damaged
    or unsupported. Reads the header and metadata only (~0.1 s), so config validation can
    refuse the file before a run writes anything."""
    _open(Path(path), "float32", "float32")


def from_gguf(
    path,
    param_dtype="float32",
    compute_dtype="float32",
    *,
    load_tokenizer: bool = True,
    scan_layers: bool = False,
):
    """(Transformer, tokenizer) from a llama.cpp GGUF file (Llama, Qwen2, Qwen3 or Gemma 3).

    Tensors are dequantised one at a time with `gguf.quants.dequantize` (numpy, fp32) and cast
    to `param_dtype`; the model computes in `compute_dtype` (see `ModelConfig`). Llama q/k
    weights are un-permuted back to the transformers layout (llama.cpp's converter permutes
    only Llama's; Qwen2 and Qwen3 keep the rotate-half layout). The tokenizer is transformers' own
    GGUF conversion (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`).
    """
    path = Path(path)
    cfg, tensors = _open(path, param_dtype, compute_dtype)
    cfg = cfg.replace(scan_layers=scan_layers)  # the parameters' layout (`ModelConfig`)
    shapes = {name: tuple(int(x) for x in t.shape) for name, t in tensors.items()}

    def read(t, name):
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as e:
            raise CheckpointError(
                f"{path}: tensor '{name}' is stored as {t.tensor_type.name}, which gguf cannot "
                "dequantise in numpy; convert the model with another type (F16, Q8_0, Q4_K)."
            ) from e
        w = w.reshape(tuple(reversed(shapes[name])))  # GGUF shapes are innermost-first
        if cfg.architecture == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rope(w, cfg.num_heads)
        elif cfg.architecture == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rope(w, cfg.num_kv_heads)
        elif cfg.architecture == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's norm scales as 1 + w
        return w

    readers = {
        hf_name(name, cfg.architecture): lambda t=t, name=name: read(t, name)
        for name, t in tensors.items()
    }
    model: Transformer = load_tensors(cfg, readers, source=str(path))
    tokenizer = gguf_tokenizer(path) if load_tokenizer else None
    return model, tokenizer


def tokenizer_cache_dir() -> str:
    """Where `gguf_tokenizer` keeps converted tokenizers: $GVPO_TOKENIZER_CACHE if set ("" turns
    the cache off), else ~/.cache/gvpo_jax/tokenizers."""
    env = os.environ.get("GVPO_TOKENIZER_CACHE")
    return env if env is not None else os.path.expanduser("~/.cache/gvpo_jax/tokenizers")


def gguf_tokenizer(path, cache_dir: str | None = None):
    """transformers' tokenizer of a GGUF file, converted once and then loaded from a cache.

    The conversion (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`) parses the file again
    and builds the BPE model from its vocabulary: 8 s for SmolLM2's 49k tokens, against 0.1 s to
    load the saved `tokenizer.json`. An entry is keyed by the file's absolute path, size and
    modification time and the transformers version, so a changed file or library converts
    again. It is written to a temporary directory and renamed into place (an interrupted write
    leaves no entry), an entry that does not load is converted again, and a cache that cannot
    be written is skipped. `cache_dir`: default `tokenizer_cache_dir()`; "" converts every time.
    """
    import transformers  # heavy import, only when a tokenizer is wanted

    path = Path(path).resolve()
    cache_dir = tokenizer_cache_dir() if cache_dir is None else cache_dir
    entry = None
    if cache_dir:
        stat = path.stat()
        key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
        entry = Path(cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:24]
        if entry.is_dir():
            try:
                return transformers.AutoTokenizer.from_pretrained(str(entry))
            except Exception:  # a damaged entry: convert again and replace it
                shutil.rmtree(entry, ignore_errors=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
    except Exception as e:  # transformers' conversion fails on a missing or odd vocabulary
        raise CheckpointError(
            f"{path} holds no tokenizer that transformers can convert ({_reason(e)}); use a GGUF "
            "file with its tokenizer, or set config.tokenizer.kind=hf with tokenizer.path."
        ) from e
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent)
            tokenizer.save_pretrained(tmp)
            try:
                os.rename(tmp, entry)
            except OSError:  # another process stored it first
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # a read-only cache costs the conversion, nothing else
    return tokenizer
