"""Tests for gvpo_jax.metrics: JSONL/TensorBoard writing, curves, summary table, lagged fetch."""

import json
import math
import os
import re
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from gvpo_jax.metrics import (
    LaggedFetch,
    MetricsWriteError,
    MetricWriter,
    plot_curves,
    read_jsonl,
    summary_table,
    to_python_scalar,
)


def _tb_events(tb_dir):
    """All Event protos of the TFRecord event files in `tb_dir` (length, crc, data, crc)."""
    events = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        buf = f.read_bytes()
        i = 0
        while i < len(buf):
            (n,) = struct.unpack("<Q", buf[i : i + 8])
            events.append(event_pb2.Event.FromString(buf[i + 12 : i + 12 + n]))
            i += 12 + n + 4
    return events


def test_write_scalars_jsonl_rows_nan_as_null_and_tb_events(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as w:
        w.write_scalars(1, {"reward_mean": jnp.float32(0.25), "kl_ref": np.float64(0.5)})
        w.write_scalars(
            2,
            {"reward_mean": 0.75, "loss": jnp.array(jnp.nan), "n_tokens": np.int32(7)},
        )
        w.write_scalars(3, {"eval": {"accuracy": jnp.array([0.5])}, "grad_norm": np.inf})
        w.flush()
    raw = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in raw and "Infinity" not in raw
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["reward_mean"] == 0.25 and rows[0]["kl_ref"] == 0.5
    assert rows[1]["reward_mean"] == 0.75 and rows[1]["loss"] is None
    assert rows[1]["n_tokens"] == 7 and isinstance(rows[1]["n_tokens"], int)
    assert rows[2]["eval/accuracy"] == 0.5 and rows[2]["grad_norm"] is None
    assert all(isinstance(r["time"], float) for r in rows)
    scalars = [
        (e.step, v.tag, v.simple_value)
        for e in _tb_events(tmp_path / "tb")
        for v in e.summary.value
        if v.HasField("simple_value")
    ]
    assert (1, "reward_mean", 0.25) in scalars and (2, "reward_mean", 0.75) in scalars
    assert (3, "eval/accuracy", 0.5) in scalars
    assert any(s == 2 and t == "loss" and math.isnan(v) for s, t, v in scalars)


def test_write_texts_to_samples_jsonl_and_tb(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as w:
        w.write_texts(4, {"sample/0": "Q: 2+2?\nA: 4", "sample/1": "\u00e9\u00e8 <eos>"})
    rows = read_jsonl(tmp_path / "samples.jsonl")
    assert rows == [{"step": 4, "sample/0": "Q: 2+2?\nA: 4", "sample/1": "\u00e9\u00e8 <eos>"}]
    tags = {v.tag for e in _tb_events(tmp_path / "tb") for v in e.summary.value}
    assert any(t.startswith("sample/0") for t in tags)


def test_disabled_writer_is_a_noop(tmp_path):
    w = MetricWriter(tmp_path / "other_process", enabled=False)
    w.write_scalars(1, {"a": 1.0})
    w.write_texts(1, {"t": "x"})
    w.flush()
    w.close()
    assert not (tmp_path / "other_process").exists()


def test_writer_appends_on_resume_and_closed_writer_is_noop(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as w:
        w.write_scalars(1, {"a": 1.0})
    w.write_scalars(2, {"a": 2.0})  # after close: ignored, not an error
    with MetricWriter(tmp_path, enabled=True) as w:
        w.write_scalars(2, {"a": 3.0})
    assert [(r["step"], r["a"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 3.0),
    ]


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
def test_a_full_disk_is_one_sentence_and_the_writer_closes_quietly(tmp_path, name):
    """/dev/full refuses every write with ENOSPC, as a full disk does: one MetricsWriteError
    (a FaultError: exit 1) naming the file, and the run's closing of the writer raises nothing."""
    os.symlink("/dev/full", tmp_path / name)
    w = MetricWriter(tmp_path, enabled=True)
    with pytest.raises(MetricsWriteError) as e:
        w.write_scalars(1, {"a": 1.0})
        w.write_texts(1, {"sample": "1+1=2"})
    message = str(e.value)
    assert message.startswith(f"{tmp_path / name} could not be written (No space left on device)")
    assert "\n" not in message and message.count(". ") == 0
    w.write_scalars(2, {"a": 2.0})  # the writer is off: nothing more, no second error
    w.close()


def test_read_jsonl_skips_truncated_last_line_only(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "a": 1}\n\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert read_jsonl(p) == [{"step": 1, "a": 1}, {"step": 2, "a": 2}]
    p.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(p)


def _rows():
    rows = [{"step": s, "reward_mean": s / 10, "kl_ref": 0.01 * s} for s in range(1, 11)]
    rows += [{"step": s, "eval/accuracy": 0.1 * s} for s in (5, 10)]
    rows += [{"step": 9, "reward_mean": None}, {"step": 10, "reward_mean": 2.0}]  # resumed run
    return rows


def test_plot_curves_writes_nonempty_png_with_a_subplot_per_present_key(tmp_path):
    out = tmp_path / "plots" / "curves.png"
    present = plot_curves(_rows(), out, title="test run")
    assert present == ["reward_mean", "eval/accuracy", "kl_ref"]  # response_len_mean absent
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 640)  # 2 columns x 2 rows at 100 dpi
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_curves(_rows(), tmp_path / "none.png", keys=("missing",))


def test_summary_table_first_last_min_max_with_last_write_wins(tmp_path):
    table = summary_table(_rows(), ["reward_mean", "eval/accuracy", "missing"])
    lines = table.splitlines()
    assert lines[0].split() == ["key", "n", "first", "last", "min", "max"]
    assert set(lines[1]) <= {"-", " "}
    # step 9 was overwritten by a null, step 10 by 2.0 -> 9 points 0.1..0.8 then 2.0
    assert lines[2].split() == ["reward_mean", "9", "0.1", "2", "0.1", "2"]
    assert lines[3].split() == ["eval/accuracy", "2", "0.5", "1", "0.5", "1"]
    assert lines[4].split() == ["missing", "0", "-", "-", "-", "-"]


def test_lagged_fetch_returns_step_t_at_t_plus_1_and_last_at_flush():
    lf = LaggedFetch()
    got = []
    for t in range(1, 4):
        m = {"loss": jnp.float32(t) * 2, "acc": {"top1": jnp.array(t / 4)}}
        got.append(lf.push(t, m))
    assert got[0] is None
    assert got[1] == (1, {"loss": 2.0, "acc/top1": 0.25})
    assert got[2] == (2, {"loss": 4.0, "acc/top1": 0.5})
    assert all(type(v) is float for v in got[2][1].values())
    assert lf.flush() == (3, {"loss": 6.0, "acc/top1": 0.75})
    assert lf.flush() is None


def test_to_python_scalar_types_and_rejects_vectors():
    assert to_python_scalar(jnp.bool_(True)) == 1
    assert type(to_python_scalar(np.int64(3))) is int
    assert type(to_python_scalar(jnp.bfloat16(1.5))) is float
    with pytest.raises(ValueError, match="not a scalar"):
        to_python_scalar(np.ones(2))


def test_wandb_sink_logs_every_row_offline_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    w = MetricWriter(tmp_path, wandb_project="gvpo-test", wandb_config={"algo": {"beta": 0.125}})
    w.write_scalars(3, {"reward_mean": 0.625, "eval": {"greedy": 0.4375}})
    w.write_texts(3, {"samples": "prompt: '1+1=' -> '2'"})
    w.close()
    run_id = (tmp_path / "wandb_id").read_text()
    w = MetricWriter(tmp_path, wandb_project="gvpo-test")  # a resumed run: same W&B run id
    w.write_scalars(4, {"reward_mean": 0.8125})
    w.close()
    assert (tmp_path / "wandb_id").read_text() == run_id
    # One offline directory per process, both named after the same run id; W&B adds "-1" to the
    # second name when both start within the same second.
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    assert all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name) for r in runs)
    # The offline run files hold the records W&B would upload (protobuf, strings verbatim).
    # W&B's service process writes them; its last records can land just after finish() returns
    # (seen once in a cold CI run), so the files are re-read for up to 20 s.
    needles = (b"reward_mean", b"0.625", b"0.8125", b"eval/greedy", b"0.4375", b"0.125",
               b"gvpo-test", b"samples")  # fmt: skip
    deadline = time.monotonic() + 20.0
    while True:
        data = b"".join(f.read_bytes() for r in runs for f in r.glob("run-*.wandb"))
        missing = [n for n in needles if n not in data]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, missing


def test_wandb_sink_is_off_by_default(tmp_path):
    w = MetricWriter(tmp_path)
    w.write_scalars(1, {"loss": 1.0})
    w.close()
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb_id").exists()


def test_the_writer_imports_no_torch_and_leaves_it_importable(tmp_path):
    """tensorboardX imports torch whenever it is installed (as it is in the suite's
    environment); the writer hides it for that import, writes its events, and a later
    `import torch` in the same process still works."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gvpo_jax.metrics import MetricWriter\n"
        f"with MetricWriter({str(tmp_path)!r}, enabled=True) as w:\n"
        "    w.write_scalars(3, {'loss': 0.5})\n"
        "print('torch' in sys.modules)\n"
        "import torch\n"
        "print(torch.ones(2).sum().item())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "2.0"]
    events = [e for e in _tb_events(tmp_path / "tb") if e.summary.value]
    assert [(e.step, e.summary.value[0].tag) for e in events] == [(3, "loss")]
