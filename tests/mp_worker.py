"""One process of the 2-process CPU test: sharded GVPO steps, an Orbax round trip, greedy samples.

Started by launch/local_multiprocess.sh (which sets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID and the fake CPU device count):
    launch/local_multiprocess.sh --num_processes 2 --devices_per_process 2 \
        --module tests.mp_worker -- --out /tmp/mp
Each process builds only its rows of every global batch (`sharding.process_rows`: a
non-contiguous set here), the model is initialised in its shards (split across the processes),
and process 0 writes `result.npz` with the gathered parameters, per-step losses and greedy
tokens. `reference_run` computes the same on one device.
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np

MODEL = "tiny"  # with NUM_LAYERS layers: compile time grows with the layer count
NUM_LAYERS = 1
GROUP = 2  # G
PROMPTS = 8  # P groups per step (global)
PROMPT_LEN, NEW = 4, 4  # Tp, N
STEPS = 3
SEED = 0
MESH = (2, 2, 1)  # data, fsdp, tensor; devices interleaved across processes (see `worker`)


def global_batch(step: int, vocab: int) -> dict[str, np.ndarray]:
    """The full P*G-row batch of `step` (deterministic; every process can build any rows)."""
    rng = np.random.default_rng(100 + step)
    B, S = PROMPTS * GROUP, PROMPT_LEN + NEW
    tokens = rng.integers(1, vocab, (B, S)).astype(np.int32)
    tokens[:, :PROMPT_LEN] = tokens[::GROUP, :PROMPT_LEN].repeat(GROUP, axis=0)  # shared prompts
    plen = rng.integers(1, PROMPT_LEN + 1, PROMPTS).repeat(GROUP)
    rlen = rng.integers(1, NEW + 1, B)
    attn = np.zeros((B, S), np.float32)
    for b in range(B):
        attn[b, PROMPT_LEN - plen[b] : PROMPT_LEN] = 1.0
        attn[b, PROMPT_LEN : PROMPT_LEN + rlen[b]] = 1.0
    return {
        "tokens": tokens,
        "attn_mask": attn,
        "resp_mask": attn[:, PROMPT_LEN:].copy(),
        "rewards": rng.random(B).astype(np.float32),
    }


def prompts(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    lens = rng.integers(1, PROMPT_LEN + 1, PROMPTS).astype(np.int32)
    ids = rng.integers(1, vocab, (PROMPTS, PROMPT_LEN)).astype(np.int32)
    return ids * (np.arange(PROMPT_LEN) < lens[:, None]), lens


def gvpo_pieces(graphdef, *, group_size: int = GROUP, prompt_len: int = PROMPT_LEN):
    """(tx, loss_fn) of the sharding tests: one GVPO loss and clipped SGD with momentum.

    SGD with momentum (an optimizer state sharded like the params) after global-norm clipping
    (a cross-shard reduction). Not AdamW: its first step lr*g/(|g|+eps) amplifies round-off of
    near-zero gradient entries up to lr/eps-fold (a 1e-8 gradient moved one weight by 4e-5),
    which says nothing about sharding. With SGD the parameter error is lr x gradient error.
    Also used by tests/test_sharding.py.
    """
    import optax

    from gvpo_jax import losses, train_step
    from gvpo_jax.batch import BatchSpec, UpdateBatch

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    gvpo = functools.partial(
        train_step.rl_loss,
        graphdef=graphdef,
        algorithm=losses.resolve("gvpo", beta=0.1),
        spec=BatchSpec(old_logp=True),
        group_size=group_size,
        prompt_len=prompt_len,
        chunk_size=4,
    )

    def loss_fn(params, b):  # these tests' rows are dicts (tokens, attn_mask, ..., old_logp)
        batch = UpdateBatch(tokens=b["tokens"], valid=b["attn_mask"], loss_mask=b["resp_mask"],
                            rewards=b["rewards"], old_logp=b["old_logp"])  # fmt: skip
        return gvpo(params, batch)

    return tx, loss_fn


def reference_run(init: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same steps on one device from the same initial parameters (`init["layers/0/..."]`)."""
    import jax
    from flax import nnx

    from gvpo_jax import models, sampler, sharding, train_step

    cfg = models.PRESETS[MODEL].replace(num_layers=NUM_LAYERS)
    graphdef, abstract = nnx.split(models.abstract_model(cfg), nnx.Param)
    flat = [
        (path, v.replace(jax.device_put(init["/".join(map(str, path))], jax.devices()[0])))
        for path, v in nnx.to_flat_state(abstract)
    ]
    params = nnx.from_flat_state(flat)
    tx, loss_fn = gvpo_pieces(graphdef)
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    rules = sharding.logical_rules(one, cfg)
    key = jax.random.key_data(jax.random.key(SEED))
    state, shardings = train_step.init_state_sharded(params, tx, key, one, rules)
    update = train_step.jit_update(loss_fn, tx, 1, mesh=one, state_shardings=shardings, rules=rules)
    logprobs = train_step.jit_logprobs(
        graphdef, prompt_len=PROMPT_LEN, chunk_size=4, mesh=one,
        param_shardings=shardings.params, rules=rules,
    )  # fmt: skip
    losses = []
    for step in range(STEPS):
        batch = global_batch(step, cfg.vocab_size)
        batch["old_logp"] = logprobs(state.params, batch["tokens"], batch["attn_mask"])
        state, m = update(state, batch)
        losses.append(float(m["loss"]))
    ids, lens = prompts(cfg.vocab_size)
    out = sampler.generate(
        nnx.merge(graphdef, state.params),
        ids,
        lens,
        sampler.SamplingSettings(max_new_tokens=NEW, temperature=0.0, group_size=GROUP),
        rng=jax.random.key(0),
    )
    flat = {
        "/".join(map(str, k)): np.asarray(v.get_value())
        for k, v in nnx.to_flat_state(jax.device_get(state.params))
    }
    return {"losses": np.asarray(losses), "tokens": np.asarray(out.tokens_BxN), **flat}


def worker(out_dir: str) -> None:
    import jax
    from flax import nnx

    from gvpo_jax import checkpoint, models, sampler, sharding, train_step

    assert sharding.maybe_initialize_distributed(), "launch with JAX_COORDINATOR_ADDRESS set"
    # Devices [p0 d0, p1 d0, p0 d1, p1 d1]: fsdp rows of the mesh are one process each (the
    # parameters are split across processes) and each process holds row shards {0, 2} or
    # {1, 3}, a non-contiguous set, as a host's chips can be on a TPU pod's ring.
    local = [jax.local_devices(process_index=p) for p in range(jax.process_count())]
    devices = [d for pair in zip(*local, strict=True) for d in pair]
    mesh = sharding.make_mesh(*MESH, devices=devices)
    cfg = models.PRESETS[MODEL].replace(num_layers=NUM_LAYERS)
    rules = sharding.logical_rules(mesh, cfg)
    model = sharding.init_sharded(cfg, mesh, SEED, rules)
    graphdef, params = nnx.split(model, nnx.Param)
    init_host = sharding.gather(params)  # the reference starts from exactly these values
    tx, loss_fn = gvpo_pieces(graphdef)
    key = jax.random.key_data(jax.random.key(SEED))
    state, shardings = train_step.init_state_sharded(params, tx, key, mesh, rules)
    update = train_step.jit_update(
        loss_fn, tx, 1, mesh=mesh, state_shardings=shardings, rules=rules
    )
    logprobs = train_step.jit_logprobs(
        graphdef,
        prompt_len=PROMPT_LEN,
        chunk_size=4,
        mesh=mesh,
        param_shardings=shardings.params,
        rules=rules,
    )
    mine = sharding.process_rows(PROMPTS * GROUP, mesh)
    ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(out_dir), save_every=1, keep=3)
    losses = []
    for step in range(STEPS):
        local = {k: v[mine.rows] for k, v in global_batch(step, cfg.vocab_size).items()}
        batch = sharding.shard_batch(local, mesh, group_size=GROUP)
        batch["old_logp"] = logprobs(state.params, batch["tokens"], batch["attn_mask"])
        state, m = update(state, batch)
        losses.append(float(m["loss"]))  # replicated scalar: readable on every process
        if step == 0:  # multi-host Orbax round trip: every process writes/reads its shards
            ckpt.save(step, state, meta={"step": step}, force=True)
            target = sharding.abstract_with_shardings(state, shardings)
            state, meta, _ = ckpt.restore(target, step=step)
            assert meta["step"] == 0
    resumed = damaged_host_restore(ckpt, state, shardings, out_dir)
    ckpt.close()
    ids, lens = prompts(cfg.vocab_size)
    prompt_rows = sharding.process_rows(PROMPTS, mesh).rows
    dev = sharding.shard_batch({"ids": ids[prompt_rows], "lens": lens[prompt_rows]}, mesh)
    out = sampler.generate_sharded(
        nnx.merge(graphdef, state.params),
        dev["ids"],
        dev["lens"],
        sampler.SamplingSettings(max_new_tokens=NEW, temperature=0.0, group_size=GROUP),
        mesh=mesh,
        rules=rules,
        rng=jax.random.key(0),
    )
    local_tokens = sharding.local_rows(out.tokens_BxN)
    assert local_tokens.shape[0] == len(prompt_rows) * GROUP
    tokens, final = sharding.gather((out.tokens_BxN, state.params))
    if sharding.is_primary():
        flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(final)}
        init = {
            "init/" + "/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(init_host)
        }
        np.savez(
            os.path.join(out_dir, "result.npz"),
            losses=np.asarray(losses),
            tokens=tokens,
            process_count=jax.process_count(),
            resumed=resumed,
            device_count=jax.device_count(),
            **flat,
            **init,
        )
    print(
        f"process {jax.process_index()}: rows {mine.rows.tolist()} (data shard {mine.index} of "
        f"{mine.count}) losses {losses}",
        flush=True,
    )


def damaged_host_restore(ckpt, state, shardings, out_dir):
    """Steps 1 and 2 saved, then one byte of process 1's own shard file of step 2 flipped: the
    sizes still match, and only the process whose share of the checksums holds that file can
    see it. Every process must resume from the same step (1). Returns the steps the processes
    resumed from, all-gathered."""
    import jax
    from jax.experimental import multihost_utils

    from gvpo_jax import checkpoint, sharding

    ckpt.save(1, state, meta={"step": 1}, force=True)
    ckpt.save(2, state, meta={"step": 2}, force=True)
    ckpt.wait()  # committed, and the manifests written (process 0)
    multihost_utils.sync_global_devices("gvpo_test_saved")
    if jax.process_index() == 1:
        mine = os.path.join(checkpoint.checkpoint_dir(out_dir), "2", "state", "ocdbt.process_1")
        files = [os.path.join(d, f) for d, _, fs in os.walk(mine) for f in fs]
        biggest = max(files, key=os.path.getsize)
        data = bytearray(open(biggest, "rb").read())
        data[len(data) // 2] ^= 0x40
        open(biggest, "wb").write(bytes(data))
    multihost_utils.sync_global_devices("gvpo_test_damaged")
    target = sharding.abstract_with_shardings(state, shardings)
    (_, meta, _), _, step = checkpoint.restore_newest(
        ckpt, None, out_dir, lambda d, s: ckpt.restore(target, step=s, directory=d),
        log=lambda line: print(line, flush=True),
    )  # fmt: skip
    assert meta["step"] == step
    return multihost_utils.process_allgather(np.int32(step))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    worker(parser.parse_args().out)
