"""A character-level tokenizer for the synthetic arithmetic demo, built in code, saved as a HF dir.

Ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>, then one id per character of `CHARS`. Encoding with
`add_special_tokens=True` (the default) prepends <bos>; decoding joins characters with no spaces
added. The result is a `transformers.PreTrainedTokenizerFast`: `save_pretrained(dir)` writes a
normal tokenizer directory that `transformers.AutoTokenizer.from_pretrained(dir)` loads.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHARS = string.digits + "+-*/=() " + string.ascii_lowercase + ".,?:"


def build_char_tokenizer(chars: str = CHARS):
    """A `PreTrainedTokenizerFast` with one token per character of `chars` (+ 4 special tokens).

    Characters outside `chars` map to <unk>. `len(tokenizer)` is the vocabulary size a
    from-scratch model needs (52 with the default `CHARS`).
    """
    import transformers  # heavy; only when a tokenizer is actually built

    if len(set(chars)) != len(chars):
        raise ValueError(f"chars {chars!r} has duplicates; each character needs one id.")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own pre-token, spaces included, so WordLevel sees single characters.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
