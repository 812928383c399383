"""gvpo_jax: GVPO and GRPO-family RL post-training of language models in JAX."""

__version__ = "0.1.0"
