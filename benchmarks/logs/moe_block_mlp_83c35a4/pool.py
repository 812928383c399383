"""Per-round MoE / dense step ratios of the `benchmarks.moe_step` runs in this folder, pooled
over each side's runs (new: 83c35a4, old: 43de791), with a 95% bootstrap over runs then rounds.
Run from the repository root: `.venv/bin/python benchmarks/logs/moe_block_mlp_83c35a4/pool.py`."""

import glob
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("moe E=8 grouped", "moe E=8 grouped no-metrics")
STAGES = ("step_s", "update_time_s", "logprob_time_s", "rollout_time_s")


def ratios(side: str, name: str, key: str) -> list[np.ndarray]:
    runs = []
    for path in sorted(glob.glob(os.path.join(HERE, f"out_{side}*.txt"))):
        with open(path) as f:
            line = next(x for x in f if x.startswith("MOE_STEP "))
        results = json.loads(line[len("MOE_STEP ") :])["results"]
        dense, moe = results["dense"]["steps"][1:], results[name]["steps"][1:]
        runs.append(np.array([m[key] / d[key] for m, d in zip(moe, dense, strict=True)]))
    return runs


def main() -> None:
    rng = np.random.default_rng(0)
    for side in ("new", "old"):
        for name in VARIANTS:
            for key in STAGES:
                runs = ratios(side, name, key)
                boots = []
                for _ in range(2000):
                    picked = [runs[i] for i in rng.integers(0, len(runs), len(runs))]
                    boots.append(np.median(np.concatenate([rng.choice(r, len(r)) for r in picked])))
                lo, hi = np.percentile(boots, [2.5, 97.5])
                per_run = [round(float(np.median(r)), 3) for r in runs]
                print(f"{side} {name:28s} {key:15s} {np.median(np.concatenate(runs)):.3f} "
                      f"[{lo:.3f}, {hi:.3f}] per run {per_run}")  # fmt: skip


if __name__ == "__main__":
    main()
