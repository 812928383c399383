import json, glob, numpy as np
rng = np.random.default_rng(0)
for side in ("new", "old"):
    for name in ('moe E=8 grouped', 'moe E=8 grouped no-metrics'):
        for key in ("step_s", "update_time_s", "logprob_time_s", "rollout_time_s"):
            runs = []
            for f in sorted(glob.glob(f'benchmarks/logs/moe_block_mlp_83c35a4/out_{side}*.txt')):
                lines = [l for l in open(f) if l.startswith('MOE_STEP ')]
                if not lines: continue
                d = json.loads(lines[0][9:])['results']
                dense = d['dense']['steps'][1:]; m = d[name]['steps'][1:]
                runs.append(np.array([a[key] / b[key] for a, b in zip(m, dense)]))
            if not runs: continue
            pooled = np.concatenate(runs)
            boots = []
            for _ in range(2000):
                rr = [runs[i] for i in rng.integers(0, len(runs), len(runs))]
                boots.append(np.median(np.concatenate([rng.choice(r, len(r)) for r in rr])))
            lo, hi = np.percentile(boots, [2.5, 97.5])
            if key == "step_s" or True:
                print(f"{side} {name:28s} {key:15s} pooled median {np.median(pooled):.3f} [{lo:.3f}, {hi:.3f}] n={len(pooled)} per run {[round(float(np.median(r)), 3) for r in runs]}")
