"""Test set-up: fake 8 CPU devices (before jax is imported), keep runs deterministic, and share
compiled programs through JAX's persistent compilation cache.

The cache lives in a per-user directory outside the clone (`GVPO_TEST_JAX_CACHE`, default
`~/.cache/gvpo_jax/jax_tests`); it is set through environment variables, so the trainer
subprocesses of the CLI, resume and multi-process tests share it too: a program compiled once
(e.g. the tiny trainer's update step) is loaded, not recompiled, by every later process. The
cache is keyed on the program, the compile options and the jax/jaxlib versions, so a stale entry
is never used; deleting the directory only costs time.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_CACHE = os.environ.get("GVPO_TEST_JAX_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "gvpo_jax", "jax_tests"
)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
