"""Data: GSM8K / MATH (TFDS builders, no TensorFlow), JSONL / parquet, the arithmetic demo task,
prompt templates and tokenisation, the character tokenizer, and the grain input pipeline.

    from gvpo_jax import data
    src = data.load_task("gsm8k", "train", path="/data/gsm8k")   # published files or download
    it = data.make_iterator(src, seed=0, batch_size=16)          # sharded by JAX process
    examples = next(it)                                          # list of example dicts
    ids, lens, kept, dropped = data.encode_prompts(tok, examples, template="boxed",
                                                   max_prompt_len=256, use_chat_template=True)
"""

from gvpo_jax.data import char_tokenizer, eval_sets
from gvpo_jax.data.arith import ArithSource, ArithTask
from gvpo_jax.data.char_tokenizer import build_char_tokenizer
from gvpo_jax.data.eval_sets import EVAL_SETS, EvalSet, EvalSetError, load_eval_set
from gvpo_jax.data.pipeline import make_iterator
from gvpo_jax.data.prompts import (
    BOXED_INSTRUCTION,
    TEMPLATES,
    PromptTemplate,
    encode_prompts,
    encode_sft,
    get_template,
    pad_batch,
    render,
)
from gvpo_jax.data.sources import (
    TASKS,
    MappedSource,
    gsm8k_solution,
    load_gsm8k,
    load_math,
    load_records,
    load_task,
)


def __getattr__(name: str):
    """The TFDS builders, imported on first use: tensorflow_datasets takes ~0.3 s to import, and a
    trainer that reads no GSM8K / MATH data (the arithmetic task, JSONL files) never needs it."""
    if name in ("GvpoGsm8k", "GvpoMath"):
        from gvpo_jax.data import tfds_builders

        return getattr(tfds_builders, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BOXED_INSTRUCTION",
    "EVAL_SETS",
    "TASKS",
    "TEMPLATES",
    "ArithSource",
    "ArithTask",
    "EvalSet",
    "EvalSetError",
    "GvpoGsm8k",
    "GvpoMath",
    "MappedSource",
    "PromptTemplate",
    "build_char_tokenizer",
    "char_tokenizer",
    "encode_prompts",
    "encode_sft",
    "eval_sets",
    "get_template",
    "gsm8k_solution",
    "load_gsm8k",
    "load_math",
    "load_eval_set",
    "load_records",
    "load_task",
    "make_iterator",
    "pad_batch",
    "render",
]
