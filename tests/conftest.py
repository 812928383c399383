"""Test set-up: fake 8 CPU devices (before jax is imported), keep runs deterministic, compile
fast, and share compiled programs through JAX's persistent compilation cache.

Compile time is most of the suite's time (tiny shapes, many programs), so the suite compiles
for speed of compilation (`TEST_XLA_FLAGS`): LLVM's optimisations off
(`--xla_backend_optimization_level=0`; XLA's default is 3) and XLA:CPU's elemental IR emitter
for fusions (`--xla_cpu_use_fusion_emitters=false`; with XLA's default, the MLIR fusion
emitters, the trainer's programs took 2.5x as long to compile), and the LLVM module compiled
whole (`--xla_cpu_parallel_codegen_split_count=1`; XLA's default splits it into up to 32 parts
to compile them on several threads, and each part pays its own set-up: with two test workers on
two cores there is no idle core to gain, and the suite took 7.5% less CPU time unsplit). The
programs are the same HLO, fused and scheduled the same way; only the CPU machine code differs.
A first run with an empty cache took 10 min 46 s of pytest with XLA's defaults and 5 min 11 s
with the first two flags (BENCHMARKS.md, "Test suite time"). jaxlib 0.11.1 removed the
elemental emitter and its flag, and XLA aborts at start-up on a flag it does not know, so the
fusion-emitter flag is passed only to an older jaxlib (the pinned one; `make newer-stack` runs
the newest).
`GVPO_TEST_XLA_FLAGS=""` runs the suite on the programs exactly as the trainer compiles them.
Subprocesses the tests start take the same flags through `child_env`.

The cache lives in a per-user directory outside the clone (`GVPO_TEST_JAX_CACHE`, default
`~/.cache/gvpo_jax/jax_tests`); it is set through environment variables, so the trainer
subprocesses of the CLI, resume and multi-process tests share it too: a program compiled once
(e.g. the tiny trainer's update step) is loaded, not recompiled, by every later process. The
cache is keyed on the program, the compile options and the jax/jaxlib versions, so a stale entry
is never used; deleting the directory only costs time.
"""

import os
import re
import tempfile
from importlib import metadata

import pytest


def _knows_fusion_emitters_flag() -> bool:
    """Whether the installed jaxlib's XLA has `--xla_cpu_use_fusion_emitters` (removed in 0.11.1),
    read from the package metadata: jax must not be imported before XLA_FLAGS is set."""
    try:
        release = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return True
    numbers = tuple(int(n) for n in re.findall(r"\d+", release)[:3])
    return numbers < (0, 11, 1)


# The suite's compile flags (see above), for this process and every subprocess (`child_env`).
TEST_XLA_FLAGS = os.environ.get(
    "GVPO_TEST_XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
    + (" --xla_cpu_use_fusion_emitters=false" if _knows_fusion_emitters_flag() else ""),
)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
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


def child_env(devices: int | None = None, **changes: str) -> dict[str, str]:
    """The environment of a subprocess the suite starts: this process's (compilation cache
    included), the suite's XLA compile flags, and `devices` fake CPU devices (None: the one real
    CPU device, e.g. a trainer run as `make demo` runs it). `changes` are set on top."""
    env = dict(os.environ, **changes)
    devices_flag = "" if devices is None else f"--xla_force_host_platform_device_count={devices} "
    env["XLA_FLAGS"] = devices_flag + TEST_XLA_FLAGS
    return env


# The test files that take longest on an empty compilation cache (measured, longest first).
# `make test` splits the suite over two workers by file (`--dist loadfile`), each taking whole
# files in collection order (`--no-loadscope-reorder`: xdist would otherwise order files by
# their number of tests, which says little about their time); a long file collected last
# leaves the other worker idle at the end (~30 s of the 7-minute cold run), so these are
# collected first. Files not listed keep their order after them.
LONGEST_FIRST = (
    "test_models.py", "test_train.py", "test_learning_study.py", "test_checkpoint_damage.py",
    "test_continuous.py", "test_resume.py", "test_gguf.py", "test_lora.py", "test_async.py",
    "test_attention.py", "test_multiprocess.py", "test_moe.py", "test_sharding.py",
    "test_buckets.py", "test_sampler.py", "test_scan.py", "test_gemma3_gguf.py",
    "test_benchmarks.py", "test_whole_step_bench.py", "test_gpu_check.py", "test_main.py",
    "test_wiring.py", "test_eval_mode.py", "test_routing_replay.py", "test_study_stale.py",
    "test_plan_moe.py",
)  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytests_base(tmp_path_factory):
    """Every temporary directory the suite's processes make (the trainer's work directories,
    tensorflow_datasets' own) lands under pytest's base directory, which pytest prunes to the
    last three runs, not in /tmp: a test worker exits without running `atexit` handlers, and a
    run's work directory made by `tempfile.mkdtemp` would otherwise stay behind."""
    base = str(tmp_path_factory.mktemp("tmp"))
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = base
    yield
    tempfile.tempdir = saved[0]
    if saved[1] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[1]


def pytest_collection_finish(session):
    """The collector settings the CLI runs with (`programs.tune_gc`), here once every test
    module is imported: the suite's own processes trace and compile most of its time."""
    from gvpo_jax import programs

    programs.tune_gc()


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable
