"""The shape of the house: imports point one way, the run is frozen, the step reads no config."""

import ast
import dataclasses
import inspect
import pathlib
import re

import pytest

import gvpo_jax
from gvpo_jax import assemble, losses, rl_step

ROOT = pathlib.Path(gvpo_jax.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Module -> the gvpo_jax modules it imports (any import statement, at any depth)."""
    names = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in names.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            # A package's __init__ re-exporting its own submodules is not a cycle of the house.
            if d.startswith(n + ".") or n.startswith(d + "."):
                continue
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_in_the_package():
    graph = _imports()
    assert "gvpo_jax.train" in graph and "gvpo_jax.assemble" in graph["gvpo_jax.train"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_run_is_frozen_and_the_step_reads_no_config():
    with pytest.raises(dataclasses.FrozenInstanceError):
        assemble.Run.__new__(assemble.Run).task = None
    source = pathlib.Path(rl_step.__file__).read_text()
    assert ".config" not in source and "ConfigDict" not in source
    assert not any(f.name == "session.py" for f in ROOT.iterdir())


def _assigned_attributes(path: pathlib.Path) -> dict[str, set[str]]:
    """Function name -> the `self.<attr>` / `<name>.<attr>` targets it assigns (a static read)."""
    out: dict[str, set[str]] = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name):
                        out.setdefault(fn.name, set()).add(f"{leaf.value.id}.{leaf.attr}")
    return out


def test_the_run_holds_nothing_a_run_changes():
    """What changes during a run (replay buffer, shuffle stream, data position, step, the queue
    of rollouts sampled ahead) lives in
    rl_step.LoopState, threaded through the loop and checkpointed; `Run` and its task hold only
    what never changes."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(assemble.Run)}
    for name, kind in fields.items():
        assert not any(t in kind for t in ("ReplayBuffer", "Generator", "LoopState")), name
    loop_fields = {f.name for f in dataclasses.fields(rl_step.LoopState)}
    assert loop_fields == {"step", "data", "np_rng", "replay", "queue"}
    # The task assigns its own attributes in its constructor only (no cursor inside it).
    task_writes = _assigned_attributes(ROOT / "tasks.py")
    assert {f for f, attrs in task_writes.items() if any(a.startswith("self.") for a in attrs)} <= {
        "__init__"
    }
    # The step and the trainer's loop never assign on the run.
    for module in ("rl_step.py", "train.py"):
        writes = set().union(*_assigned_attributes(ROOT / module).values())
        assert not {w for w in writes if w.split(".")[0] in ("run", "run_")}, module


def test_the_assigned_attributes_reader_sees_an_assignment(tmp_path):
    code = "class T:\n    def go(self):\n        self.position += 1\n        run.x = 2\n"
    path = tmp_path / "m.py"
    path.write_text(code)
    assert _assigned_attributes(path) == {"go": {"self.position", "run.x"}}


def _sources() -> dict[str, str]:
    return {str(f.relative_to(ROOT.parent)): f.read_text() for f in ROOT.rglob("*.py")}


def test_one_name_per_thing():
    """Names retired for a second name of the same thing stay retired in the package."""
    retired = {
        "activation_dtype": "the compute dtype is `compute_dtype`",
        "storage_dtype": "the parameters' dtype is `param_dtype`",
        "informative_mask": "the group filter is `informative_groups`",
        '"sample_logp"': "the batch holds the sampler's logp_BxN as `rollout_logp`",
        "num_samples": "the G responses of a prompt are `group_size`",
        "groups=": "continuous batching's row shards are `queues`",
    }
    for path, text in _sources().items():
        for name, why in retired.items():
            assert name not in text, f"{path} uses {name}: {why}"


def test_caches_are_typed_and_attention_lives_with_them():
    """KV caches are dataclasses (models/cache.py), never dicts whose keys pick the code path;
    the kernels are in models/attention.py only."""
    from gvpo_jax.models import cache

    for cls in (cache.KVCache, cache.SharedPrefixCache, cache.SlotCache):
        assert dataclasses.is_dataclass(cls) and callable(cls.attend)
    for path, text in _sources().items():
        for key in ('"prefix_', '"kT"', '"vT"', '["k"]', '["v"]', '["valid"]'):
            assert key not in text, f"{path} indexes a cache by {key}"
    assert not (ROOT / "models" / "fused.py").exists()


def _defined(module: str) -> set[str]:
    """The functions and classes a module defines at its top level."""
    tree = ast.parse((ROOT / module).read_text())
    kinds = (ast.FunctionDef, ast.ClassDef)
    return {node.name for node in tree.body if isinstance(node, kinds)}


def test_files_are_named_for_their_jobs():
    """train.py holds the trainer (the mode, the RL loop, SFT); resume, the evaluation of a run
    and export live in the modules named for them; the sampler's host side is apart from its
    decode loops; Hugging Face loading is the models' own."""
    jobs = {
        "resume.py": {"restore", "save", "reference_copy", "check_lora_layout", "check_base"},
        "eval.py": {"evaluate_held_out", "evaluate_sets", "describe_policy"},
        "export.py": {"export"},
        "decode.py": {"SamplingSettings", "static_batch", "continuous_batch", "SlotState"},
        "models/hf.py": {"hf_model_config", "from_pretrained"},
    }
    for module, names in jobs.items():
        assert names <= _defined(module), (module, names - _defined(module))
    moved = set().union(*jobs.values())
    for module in ("train.py", "sampler.py", "sharding.py"):
        assert not _defined(module) & moved, (module, _defined(module) & moved)
    assert {"run", "rl_loop", "run_sft"} <= _defined("train.py")

    # No decode loop in the sampler: its while loops are decode.py's.
    def loops(module):
        tree = ast.parse((ROOT / module).read_text())
        return sum(isinstance(n, ast.Attribute) and n.attr == "while_loop" for n in ast.walk(tree))

    assert loops("sampler.py") == 0 and loops("decode.py") >= 3
    # No Hugging Face in the mesh code, and no mesh code in the models.
    mesh_code = (ROOT / "sharding.py").read_text()
    assert not any(word in mesh_code for word in ("hf_", "config.json", "safetensors", "gguf"))
    graph = _imports()
    for name, deps in graph.items():
        if name.startswith("gvpo_jax.models"):
            outside = {d for d in deps if not d.startswith("gvpo_jax.models")}
            assert outside <= {"gvpo_jax.errors"}, (name, outside)
    # Old checkpoints' bytes path (grain iterator states) is gone.
    assert "base64" not in (ROOT / "checkpoint.py").read_text()


def test_the_sampler_settings_are_one_static_argument():
    """The sampler's settings are spelled once, in `decode.SamplingSettings` (frozen, hashable),
    and travel as that one object: no function of the sampler takes them keyword by keyword."""
    import inspect

    from gvpo_jax import decode, sampler

    settings = decode.SamplingSettings(max_new_tokens=4, eos_ids=[2, 1])
    assert settings.eos_ids == (2, 1) and hash(settings) == hash(dataclasses.replace(settings))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.temperature = 0.5
    fields = {f.name for f in dataclasses.fields(decode.SamplingSettings)}
    functions = [sampler.generate, sampler.generate_sharded, sampler.generate_split.__wrapped__]
    for fn in functions:
        params = set(inspect.signature(fn).parameters)
        assert "settings" in params and not params & fields, (fn.__name__, params & fields)
    assert sampler.SamplingSettings is decode.SamplingSettings
    assert not hasattr(sampler, "_Hashable")


# config.algo's fields that make the algorithm (the rest are the step's layout: epochs,
# minibatches, replay): read in config.algorithm only, where losses.resolve builds it.
ALGORITHM_FIELDS = ("name", "beta", "anchor", "eps_low", "eps_high", "kl_coef", "reward_kl_coef",
                    "entropy_coef", "rollout_correction", "rollout_is_cap", "dynamic_sampling",
                    "overlong_cache", "overlong_factor")  # fmt: skip


def test_the_algorithm_is_read_from_the_config_once():
    """Only config.py reads the algorithm's settings (`config.algorithm` builds the
    `losses.Algorithm`, `validate` checks through it); the run holds the object, and the
    step, the loss and the updater take it. losses.py stays config-free."""
    pattern = re.compile(r"\.algo\.(" + "|".join(ALGORITHM_FIELDS) + r")\b")
    for path, text in _sources().items():
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        if path != "gvpo_jax/config.py":
            assert not pattern.search(code.replace('"config.algo.', "")), path
    losses_src = (ROOT / "losses.py").read_text()
    assert "ml_collections" not in losses_src and "config" not in _imported_names(losses_src)
    assert dataclasses.is_dataclass(losses.Algorithm) and losses.Algorithm.__hash__ is not None
    fields = {f.name for f in dataclasses.fields(rl_step.StepSettings)}
    assert {"algorithm", "reference", "spec"} <= fields
    assert not fields & {"dynamic_sampling", "overlong", "corrected", "sampler_anchor",
                         "batch_advantages", "reference_adapters_off"}  # fmt: skip


def test_one_update_path_fixed_at_trace_time():
    """The update batch is typed (`batch.UpdateBatch`: what exists apart from what the loss
    counts, a place for integer per-token records); `rl_loss` takes its path from the
    Algorithm and the BatchSpec, never from which keys or fields a batch holds; the step has
    one updater (full width is its one-bucket case) and no branch on buckets."""
    from gvpo_jax import batch, train_step

    fields = {f.name for f in dataclasses.fields(batch.UpdateBatch)}
    assert {"tokens", "valid", "loss_mask", "rewards", "routing", "packed"} <= fields
    rl_loss = inspect.getsource(train_step.rl_loss)
    for tell in (" in batch", "batch.get(", "batch[", "is None", "is not None"):
        assert tell not in rl_loss, tell
    assert "spec: BatchSpec" in rl_loss and "algorithm: losses.Algorithm" in rl_loss
    step = (ROOT / "rl_step.py").read_text()
    assert "bucket" not in step and step.count("updater.update(") == 1
    assert not {"update", "logprobs", "buckets", "needs_reference"} & {
        f.name for f in dataclasses.fields(assemble.Run)
    }


def test_step_means_the_rl_step():
    """One meaning for "step": the RL step (`LoopState.step`). The run's settings are
    `Run.settings`, the optimizer's count `TrainState.updates`."""
    from gvpo_jax import train_step

    run_fields = {f.name for f in dataclasses.fields(assemble.Run)}
    state_fields = {f.name for f in dataclasses.fields(train_step.TrainState)}
    assert "settings" in run_fields and "step" not in run_fields
    assert "updates" in state_fields and "step" not in state_fields
    assert "step" in {f.name for f in dataclasses.fields(rl_step.LoopState)}


def _imported_names(text: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[-1] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.name for a in node.names} | {(node.module or "").split(".")[-1]}
    return names


def test_one_mesh_divisibility_check():
    """Row-shard divisibility is checked in one place (sharding.check_split): no other module
    takes a count modulo the row shards."""
    for path, text in _sources().items():
        if path.endswith("sharding.py"):
            continue
        for pattern in ("% shards", "% sharding.batch_shards", "% (data * fsdp)"):
            assert pattern not in text, f"{path}: {pattern}"


# The lab: scripts that drive the library from outside it (benchmarks, learning studies, the
# generators of the docs); they use the package's public names only.
LAB = ("benchmarks", "studies", "tools")


def _private_uses(source: str) -> list[str]:
    """Private names of the package a script reaches: `from gvpo_jax.x import _name`, and
    `m._name` (at any depth: `m.Class._name`) where `m` is bound to gvpo_jax or one of its
    modules (`import gvpo_jax.x as m`, `from gvpo_jax import x as m`)."""
    tree = ast.parse(source)
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "gvpo_jax" or a.name.startswith("gvpo_jax."):
                    bound.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "gvpo_jax" or node.module.startswith("gvpo_jax."):
                for a in node.names:
                    if a.name.startswith("_"):
                        found.append(f"from {node.module} import {a.name}")
                    bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
            found.append(".".join([base.id, *reversed(chain)]))
    return found


def test_the_lab_uses_public_names_of_the_package_only():
    """Benchmarks and studies drive the library through its public names (`train.run(...,
    on_step=...)`, `train.rl_loop`, `assemble.assemble`, ...), never a private one, so a refactor
    of the library's insides cannot silently break them."""
    scripts = [f for d in LAB for f in sorted((ROOT.parent / d).rglob("*.py"))]
    assert any(f.parent.name == "studies" for f in scripts), "no study script found"
    uses = {str(f.relative_to(ROOT.parent)): _private_uses(f.read_text()) for f in scripts}
    assert not {f: u for f, u in uses.items() if u}


def test_the_private_name_reader_sees_each_way_in():
    source = (
        "import gvpo_jax.models.lora as lora\nfrom gvpo_jax import train, config as cfg\n"
        "from gvpo_jax.sampler import _loop, generate\nimport numpy as np\n"
        "train._run_mode(1)\ncfg.base_config()\nlora.LoRASpec._fields\nnp._private\n"
        "train.__file__\nx = generate._cache_size\n"
    )
    assert sorted(_private_uses(source)) == sorted([
        "from gvpo_jax.sampler import _loop", "train._run_mode", "lora.LoRASpec._fields",
        "generate._cache_size",
    ])  # fmt: skip


def _module_imports() -> list[str]:
    """`module -> imports` lines of docs/architecture.md: the package's top-level modules with
    its subpackages as one (data/, models/, rewards/), then the modules inside models/, then
    what each folder of the lab (benchmarks/, studies/, tools/) imports from the package."""

    packages = {f.name for f in ROOT.iterdir() if (f / "__init__.py").exists()}

    def room(name: str) -> str:
        part = name.split(".")[1]
        return part + "/" if part in packages else part

    graph = {k: v for k, v in _imports().items() if k != "gvpo_jax"}
    rooms: dict[str, set[str]] = {}
    for name, deps in graph.items():
        deps_rooms = {room(d) for d in deps if d != "gvpo_jax"}
        rooms.setdefault(room(name), set()).update(deps_rooms - {room(name)})
    lines = [f"{k} -> {', '.join(sorted(v))}".rstrip() for k, v in sorted(rooms.items())]
    inner = {k: v for k, v in graph.items() if k.startswith("gvpo_jax.models.")}
    short = lambda n: "models/" + n.split(".")[-1]  # noqa: E731
    for name, deps in sorted(inner.items()):
        within = sorted(short(d) for d in deps if d.startswith("gvpo_jax.models."))
        lines.append(f"{short(name)} -> {', '.join(within)}".rstrip())
    names = {n for n in graph} | {"gvpo_jax." + p for p in packages}
    for lab in LAB:  # what the lab's scripts take from the package (public names only)
        deps = set()
        for f in (ROOT.parent / lab).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    deps.update({node.module} | {f"{node.module}.{a.name}" for a in node.names})
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
        rooms_used = sorted({room(d) for d in deps if d in names})
        lines.append(f"{lab}/ (lab) -> {', '.join(rooms_used)}".rstrip())
    return lines


def test_the_architecture_doc_lists_the_imports_the_code_has():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = doc.split("<!-- imports:begin -->")[1].split("<!-- imports:end -->")[0]
    listed = [line for line in block.strip().strip("`").strip().splitlines()]
    assert listed == _module_imports(), "\n".join(
        ["regenerate with:", "python -m tests.test_layout"]
    )


if __name__ == "__main__":  # prints the import list of docs/architecture.md
    print("\n".join(_module_imports()))
