"""A study's arms as configs: `<study>/configs/<arm>.py` defines `get_config(arg)` (big_vision's
`configs/proj/<project>/`), the swept settings its argument ("regime=4mbx2ep,lr=3", "k=4,tis";
"quick" the smoke-test sizes) and the seed a field. A cell is the string `--config` takes, so
    python -m gvpo_jax.main --config=studies/stale/configs/grpo.py:k=4,tis --config.seed=1
runs one cell's settings as a plain trainer run (the study adds its own protocol: a shared
start, a budget of sampled responses, evaluations along it).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import types

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Minibatches x epochs per rollout: one update per rollout, the official GVPO recipe's regime,
# and the off-policy regime of part 1 (later minibatches update on samples of an older policy).
REGIMES = {"on": (1, 1), "4mbx1ep": (4, 1), "4mbx2ep": (4, 2)}


def parse(arg: str | None, **defaults) -> types.SimpleNamespace:
    """ "k=4,tis" -> k=4 (converted to its default's type), tis=True; a bare word is a flag.
    Unknown names are an error (a typo would otherwise run the base config)."""
    values = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, sep, text = item.partition("=")
        if key not in defaults:
            raise ValueError(f"unknown config argument {key!r}; known: {', '.join(defaults)}")
        default = defaults[key]
        if not sep:
            values[key] = True
        elif isinstance(default, bool):
            values[key] = text.lower() in ("1", "true", "yes")
        elif isinstance(default, int | float | str):
            values[key] = type(default)(text)
        else:  # a None default: a Python literal, else the text
            try:
                values[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                values[key] = text
    return types.SimpleNamespace(**values)


def set_regime(c: ml_collections.ConfigDict, regime: str) -> None:
    c.algo.num_minibatches, c.algo.num_epochs = REGIMES[regime]


def load(spec: str) -> ml_collections.ConfigDict:
    """`get_config(arg)` of "path/to/arm.py:arg" (a path relative to the repository), as
    `--config=path/to/arm.py:arg` loads it."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(path))[0], os.path.join(REPO, path)
    )
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def flat(c: ml_collections.ConfigDict | dict, prefix: str = "") -> dict:
    """Dotted field -> value of every leaf of a config."""
    out = {}
    for key, value in (c.to_dict() if isinstance(c, ml_collections.ConfigDict) else c).items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def overrides(config: ml_collections.ConfigDict, base: ml_collections.ConfigDict) -> list:
    """The (dotted field, value) pairs in which `config` differs from `base`, sorted."""
    a, b = flat(config), flat(base)
    missing = object()
    return sorted((k, v) for k, v in a.items() if b.get(k, missing) != v)


def repo_config(name: str):
    """`get_config()` of the repository's configs/<name>.py (the file the CLI's --config runs)."""
    return load(f"configs/{name}.py")


def quiet_config(c):
    """A config's run without export, plots, periodic checkpoints, sample logs or evaluations
    of its own (the study evaluates), on all devices."""
    c.train.export = False
    c.train.plot = False
    c.train.checkpoint_every = 10**9
    c.train.sample_log_every = 0
    c.train.eval_every = 0
    if "kl_ref_metric" in c.train:  # the study measures KL to the start itself, at the end
        c.train.kl_ref_metric = False
    c.mesh.data = -1  # all devices: one on a plain CPU (the test runs the script without fakes)
    return c
