"""Small helpers shared by test files."""

import jax

# Step metrics that count the programs a run met (`programs.Counter`): a second run in the same
# process, or one reading the persistent compilation cache, finds programs already made, so two
# runs that agree bit for bit still differ here (as in their wall-clock times).
PROGRAM_COUNTS = ("new_programs", "programs_compiled_ahead", "programs_reached_first")

# A tiny Qwen3-MoE policy for the trainer's toy configs: 4 experts of width 16, top-2.
MOE_OVERRIDES = {
    "model.overrides.architecture": "qwen3_moe",
    "model.overrides.qk_norm": True,
    "model.overrides.attention_bias": False,
    "model.overrides.num_experts": 4,
    "model.overrides.num_experts_per_tok": 2,
    "model.overrides.moe_intermediate_size": 16,
}


def scale_matrices(state, factor: float, stacked: bool):
    """Every parameter that is a matrix or more per layer (kernels and biases, not the norm
    scales) times `factor`. `stacked`: the model's blocks are stacked [L, ...] (scan_layers),
    so the leaves under `layers` have one more dimension than a layer's."""

    def scale(path, x):
        per_layer = x.ndim - (stacked and "'layers'" in jax.tree_util.keystr(path))
        return x * factor if per_layer > 1 else x

    return jax.tree_util.tree_map_with_path(scale, state)


QWEN_SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>", "<think>", "</think>"]  # fmt: skip


def qwen_char_tokenizer():
    """A character-level tokenizer holding Qwen3's special tokens whole (every printable
    character its own token), so a text's ids are exactly its characters and a chat format's
    dropped or added separator shows as a token."""
    import string

    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(string.printable))
    vocab = {t: i for i, t in enumerate(QWEN_SPECIALS + ["<unk>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "\n" too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(QWEN_SPECIALS + ["<unk>"])  # every id decodes and encodes back
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
