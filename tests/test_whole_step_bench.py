"""The whole-step benchmark's quick mode (tiny random model, our side only), so it cannot rot.

The peers' side (TRL, tunix) needs their own virtualenvs and is exercised by running the
benchmark itself (benchmarks/whole_step.py).
"""

import pytest

from benchmarks import whole_step


@pytest.mark.timeout(300)
def test_quick_mode_times_both_of_our_steps_alone_then_the_first_again():
    """--alone: each worker runs all its steps by itself (for peers that do not fit in memory
    beside ours), then the first worker once more, so drift over the run is on record."""
    ours = f"grpo:{whole_step.LENGTH_BUCKETS}{whole_step.OURS}"  # GVPO's worker is the same
    out = whole_step.main(["--quick", "--steps", "2", "--warmup", "1", "--alone", "--ours", ours])
    s = whole_step.QUICK
    rows = s["prompts"] * s["samples"]
    # the default: packed groups in the update and a decode shedding rows twice
    grpo = "gvpo_jax grpo +pack +shed2"
    assert list(out["steps"]) == [grpo, f"{grpo} (again)"]
    for name, steps in out["steps"].items():
        assert len(steps) == 3, name  # warm-up + 2 timed, one per round
        for r in steps:
            assert all(r[f"{k}_pad_ratio"] >= 1 for k in ("update", "logprob", "decode")), r
            assert r["step_s"] > 0 and 0 < r["tokens"] <= rows * s["max_new_tokens"], (name, r)
            # the worker's own memory, now and at its peak (two counters: a page's slack)
            assert 0.1 < r["rss_gib"] < r["peak_rss_gib"] + 0.01 < 24, r
            stages = [r[k] for k in whole_step.STAGES]
            assert all(x >= 0 for x in stages) and sum(stages) <= r["step_s"], (name, r)
        summary = out["summary"][name]
        assert summary["first_s"] == steps[0]["step_s"]  # the compiling step is reported apart
        timed = sorted(x["step_s"] for x in steps[1:])
        assert summary["min_s"] == timed[0] and summary["max_s"] == timed[-1]
        assert summary["peak_rss_gib"] == max(x["peak_rss_gib"] for x in steps)
        # The first step traces every program; the median of the steps that traced none
        # leaves out the ones that met a new packed width.
        first = steps[0]
        assert first["traced"] > 0 and first["compile_s"] >= first["trace_s"] + first["lower_s"]
        assert first["trace_s"] > 0 and first["lower_s"] > 0
        clean = [x["step_s"] for x in steps[1:] if x["traced"] == 0]
        assert summary["clean_steps"] == len(clean)
        assert summary["traced"] == sum(x["traced"] for x in steps[1:])
