"""Metric writer (JSONL + TensorBoard from process 0), one-step-late fetching, curves and tables."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm

from gvpo_jax import errors

DEFAULT_PLOT_KEYS = ("reward_mean", "eval/accuracy", "response_len_mean", "kl_ref")
# Metrics shown on the progress line, in this order, when present.
PROGRESS_KEYS = ("reward_mean", "accuracy", "response_len_mean", "loss", "kl_ref", "grad_norm")


class MetricsWriteError(errors.FaultError):
    """The metric files could not be written (a full disk, a quota): one sentence; the writer
    writes nothing more, and the checkpoints written before are intact."""


def to_python_scalar(value: Any) -> int | float:
    """A Python int/float from a jax/numpy/Python scalar (or size-1 array); bools become 0/1.

    Fetching a jax array blocks until the device has computed it; feed `LaggedFetch`
    output here to avoid stalling the device.
    """
    arr = np.asarray(jax.device_get(value))
    if arr.size != 1:
        raise ValueError(f"metric value of shape {arr.shape} is not a scalar; reduce it first.")
    item = arr.reshape(()).item()
    if isinstance(item, bool):
        return int(item)
    if isinstance(item, int):
        return item
    return float(item)


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become '/'-joined names (TensorBoard groups tags by the prefix)."""
    out = {}
    for k, v in metrics.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, name + "/"))
        else:
            out[name] = v
    return out


def _summary_writer_class():
    """tensorboardX's `SummaryWriter`, imported without importing PyTorch.

    tensorboardX's writer module imports torch at import time whenever it is installed (only to
    accept torch tensors, which this writer never passes), and gvpo_jax never imports torch: in
    an environment that has it (the test suite's, a user's with TRL beside) that import took
    ~2 CPU-s and ~0.2 GiB per trainer process. So while tensorboardX is first imported, `torch`
    reads as absent (its own `ImportError` path); a process that already imported torch keeps it.
    """
    if "tensorboardX.writer" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
        try:
            import tensorboardX  # noqa: F401
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter


class MetricWriter:
    """Writes `<workdir>/metrics.jsonl`, `<workdir>/samples.jsonl` and TensorBoard `<workdir>/tb`.

    Only process 0 writes (`enabled=None` means `jax.process_index() == 0`); elsewhere every
    method is a no-op, so the train loop calls it unconditionally. Files are appended to,
    so a resumed run continues them; rows repeated after resuming from an older checkpoint
    are resolved by `plot_curves`/`summary_table` (the last row written for a step wins).
    Each JSONL row is {"step": int, "time": unix seconds, name: value, ...} with non-finite
    values written as null (JSON has no NaN).

    `wandb_project` (optional) also logs every row to Weights & Biases (`pip install wandb`;
    `WANDB_MODE=offline` keeps it on disk). The W&B run id is kept in `<workdir>/wandb_id`, so a
    resumed run continues the same W&B run. Rows carry their own `step` as the x-axis (the SFT
    phase, evaluations and RL steps count steps differently).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        enabled: bool | None = None,
        wandb_project: str = "",
        wandb_config: Mapping[str, Any] | None = None,
    ):
        self.workdir = Path(workdir)
        self.enabled = jax.process_index() == 0 if enabled is None else bool(enabled)
        self._jsonl = self._samples = self._tb = self._wandb = None
        if not self.enabled:
            return
        SummaryWriter = _summary_writer_class()

        self.workdir.mkdir(parents=True, exist_ok=True)
        # Line-buffered: every row reaches the OS at once, so a crash loses at most one line.
        self._jsonl = open(self.workdir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self._tb = SummaryWriter(logdir=str(self.workdir / "tb"), flush_secs=30)
        if wandb_project:
            self._wandb = _wandb_run(self.workdir, wandb_project, dict(wandb_config or {}))

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        """One JSONL row and one TensorBoard scalar per name (nested dicts joined with '/')."""
        if not self.enabled:
            return
        values = {k: to_python_scalar(v) for k, v in flatten(scalars).items()}
        row = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        with self._refused("metrics.jsonl"):
            self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        for k, v in values.items():
            self._tb.add_scalar(k, v, int(step))
        if self._wandb is not None:
            self._wandb.log({"step": int(step), **values})

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Text (e.g. sampled completions) to TensorBoard and one row of `samples.jsonl`."""
        if not self.enabled:
            return
        texts = {k: str(v) for k, v in flatten(texts).items()}
        with self._refused("samples.jsonl"):
            if self._samples is None:
                self._samples = open(self.workdir / "samples.jsonl", "a", buffering=1)  # noqa: SIM115
            self._samples.write(json.dumps({"step": int(step), **texts}) + "\n")
        for k, v in texts.items():
            self._tb.add_text(k, v, int(step))
        if self._wandb is not None:
            import wandb

            self._wandb.log(
                {"step": int(step), **{k: wandb.Html(f"<pre>{v}</pre>") for k, v in texts.items()}}
            )

    @contextlib.contextmanager
    def _refused(self, name: str):
        """A write the disk refuses (full, quota, size limit) -> one MetricsWriteError; the
        writer is then off, so closing it at the run's end neither writes nor raises again."""
        try:
            yield
        except OSError as e:
            self.enabled = False
            raise MetricsWriteError(
                f"{self.workdir / name} could not be written ({e.strerror or e}); the checkpoints "
                "written before are intact: free space and rerun to resume from the latest."
            ) from e

    def flush(self) -> None:
        if not self.enabled:
            return
        with self._refused("metrics.jsonl"):
            for f in (self._jsonl, self._samples, self._tb):
                if f is not None:
                    f.flush()

    def close(self) -> None:
        if not self.enabled:
            for f in (self._jsonl, self._samples, self._tb):  # after a refused write: quietly
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
            self._jsonl = self._samples = self._tb = None
            return
        with self._refused("metrics.jsonl"):
            for f in (self._jsonl, self._samples, self._tb):
                if f is not None:
                    f.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._samples = self._tb = self._wandb = None
        self.enabled = False  # further writes are no-ops rather than errors on closed files

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wandb_run(workdir: Path, project: str, config: dict):
    """A W&B run in `workdir`, resumed when the workdir already has one (same run id)."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "config.train.wandb_project is set but wandb is not installed; run "
            "`pip install wandb==0.31.0` or leave train.wandb_project empty."
        ) from e
    id_file = workdir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    run = wandb.init(
        project=project,
        dir=str(workdir),
        id=run_id,
        resume="allow",
        config=config,
        name=workdir.name,
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL file; a truncated last line (a crash mid-write) is skipped."""
    lines = Path(path).read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
    return rows


def _series(rows: Iterable[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key`, sorted by step; the last row written for a step wins."""
    by_step = {}
    for r in rows:
        if key in r and "step" in r:
            by_step[int(r["step"])] = r[key]
    by_step = {s: v for s, v in by_step.items() if v is not None}
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def plot_curves(
    rows: list[dict],
    out_png: str | os.PathLike,
    keys: Iterable[str] = DEFAULT_PLOT_KEYS,
    title: str = "gvpo_jax training curves",
) -> list[str]:
    """Writes one PNG with a subplot (value vs step) per key that has data; returns those keys."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = {k: _series(rows, k) for k in keys}
    present = [k for k, (s, _) in series.items() if s.size]
    if not present:
        raise ValueError(f"none of the keys {list(keys)} has a value in the rows; nothing to plot.")
    ncols = min(2, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax, k in zip(axes, present, strict=False):
        steps, values = series[k]
        ax.plot(steps, values, marker="." if steps.size < 50 else None, lw=1.2)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(present) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return present


def summary_table(rows: list[dict], keys: Iterable[str]) -> str:
    """Plain-text table: n, first, last, min, max per key (per-step last-wins, nulls skipped)."""
    header = ("key", "n", "first", "last", "min", "max")
    table = [header]
    for k in keys:
        _, v = _series(rows, k)
        if v.size:
            nums = [f"{x:.4g}" for x in (v[0], v[-1], v.min(), v.max())]
            table.append((k, str(v.size), *nums))
        else:
            table.append((k, "0", "-", "-", "-", "-"))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class LaggedFetch:
    """Returns step t's device metrics at step t+1, so fetching never stalls the device.

    `push(t, metrics)` starts the device-to-host copy of step t's arrays and returns the
    previous step's metrics as (step, {name: Python scalar}) (None on the first push);
    by then the device has long finished them and is busy with step t. `flush()` returns
    the last pushed step (call it at the end of training or before a checkpoint).
    """

    def __init__(self):
        self._pending: tuple[int, Mapping[str, Any]] | None = None

    def push(self, step: int, metrics: Mapping[str, Any]) -> tuple[int, dict] | None:
        for leaf in jax.tree_util.tree_leaves(metrics):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
        previous, self._pending = self._pending, (int(step), metrics)
        return self._fetch(previous)

    def flush(self) -> tuple[int, dict] | None:
        previous, self._pending = self._pending, None
        return self._fetch(previous)

    @staticmethod
    def _fetch(item: tuple[int, Mapping[str, Any]] | None) -> tuple[int, dict] | None:
        if item is None:
            return None
        step, metrics = item
        host = jax.device_get(flatten(metrics))
        return step, {k: to_python_scalar(v) for k, v in host.items()}


class Progress:
    """A tqdm bar with the key metrics on a terminal; one plain line per log step otherwise."""

    def __init__(self, total: int, initial: int, log_every: int):
        self.tty = sys.stdout.isatty()
        self.primary = jax.process_index() == 0
        self.total, self.log_every = total, log_every
        self.bar = tqdm.tqdm(
            total=total,
            initial=initial,
            desc="rl",
            dynamic_ncols=True,
            disable=not self.tty or not self.primary,
        )

    def update(self, step: int, m: Mapping[str, float]) -> None:
        shown = {k.split("/")[-1]: f"{m[k]:.3f}" for k in PROGRESS_KEYS if k in m}
        t = m.get("rollout_time_s", 0) + m.get("update_time_s", 0)
        if self.tty:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif self.primary and (step % self.log_every == 0 or step == self.total):
            text = "  ".join(f"{k} {v}" for k, v in shown.items())
            print(f"[rl] step {step}/{self.total}  {text}  ({t:.2f}s)", flush=True)

    def close(self) -> None:
        self.bar.close()


def sample_texts(examples, completions, group_size: int, count: int = 4) -> dict[str, str]:
    """A few prompts with the first completion of their group, as one text for the writer."""
    lines = []
    for i in range(min(count, len(examples))):
        ex = examples[i]
        lines.append(
            f"prompt: {ex['prompt']!r} gold: {ex['answer']!r} -> {completions[i * group_size]!r}"
        )
    return {"samples": "\n".join(lines)}
