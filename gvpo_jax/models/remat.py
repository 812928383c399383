"""Per-block rematerialisation ordered after the backward pass reaches the block.

`block_forward_remat` is what `Transformer.hidden` runs per layer when `ModelConfig.remat` is on:
the forward keeps only each block's inputs, and the block is recomputed in the backward pass in
layer order (see its docstring for why `jax.checkpoint` / `nnx.remat` do not do that on XLA CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def block_forward(block, x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index, routing=None):
    return block(x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index, routing)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def block_forward_remat(
    block, x_BxTxD, positions_BxT, valid_BxT, layer_cache, cache_index, routing=None
):
    """`block_forward` recomputed in the backward pass, in layer order.

    Like `nnx.remat`, the forward keeps only the block's inputs. Unlike it, the recomputation
    cannot start before the cotangent of the block's output exists: a zero computed from that
    cotangent is added to the saved inputs and to the parameters before they are used again.
    `jax.checkpoint` orders nothing after the cotangent, and its optimization barriers are
    dropped before XLA CPU schedules: there XLA hoisted every layer's recomputation (and the
    all-gathers of its FSDP-sharded weights) to the start of the backward pass, so remat saved
    nothing (compiled temporaries grew by a whole layer per layer) and each layer's gathered
    weights stayed live from the forward to its backward. A data dependence holds on every
    backend; its cost is one elementwise add over each layer's inputs and local weight shards.
    """
    graphdef, state = nnx.split(block)
    cache_float, cache_rest = _split_floats(layer_cache)
    aux = (positions_BxT, valid_BxT, cache_rest, cache_index, routing)
    x_BxTxD, new_float, new_rest, routes = _remat_apply(graphdef, state, x_BxTxD, cache_float, aux)
    return x_BxTxD, _merge_floats(new_float, new_rest), routes


def _split_floats(tree):
    """(floating leaves, other leaves) of a pytree, each with None in the other's places."""
    if tree is None:
        return None, None
    floats = jax.tree.map(lambda a: a if _is_float(a) else None, tree)
    rest = jax.tree.map(lambda a: None if _is_float(a) else a, tree)
    return floats, rest


def _merge_floats(floats, rest):
    if floats is None:
        return None
    return jax.tree.map(
        lambda f, r: r if f is None else f, floats, rest, is_leaf=lambda a: a is None
    )


def _remat_call(graphdef, state, x_BxTxD, cache_float, aux):
    positions_BxT, valid_BxT, cache_rest, cache_index, routing = aux
    block = nnx.merge(graphdef, state)
    x_BxTxD, cache, routes = block(
        x_BxTxD,
        positions_BxT,
        valid_BxT,
        _merge_floats(cache_float, cache_rest),
        cache_index,
        routing,
    )
    new_float, new_rest = _split_floats(cache)
    return x_BxTxD, new_float, new_rest, routes


def _after(x, tree):
    """tree + a zero computed from x: its uses cannot be scheduled before x exists."""
    zero = jnp.sum(x[:, :1, :1].astype(jnp.float32)) * 0.0
    return jax.tree.map(lambda a: a + zero.astype(a.dtype), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat_apply(graphdef, state, x_BxTxD, cache_float, aux):
    return _remat_call(graphdef, _after(x_BxTxD, state), x_BxTxD, cache_float, aux)


def _remat_fwd(graphdef, state, x_BxTxD, cache_float, aux):
    # The forward's parameters are tied to the block's input as well: XLA CPU otherwise issued
    # every layer's FSDP all-gathers at the start of the step and kept all of them live until
    # their layer ran (+0.76 GiB per layer per device at Qwen2.5-7B width).
    out = _remat_call(graphdef, _after(x_BxTxD, state), x_BxTxD, cache_float, aux)
    return out, (state, x_BxTxD, cache_float, aux)


def _remat_bwd(graphdef, saved, cotangents):
    state, x_BxTxD, cache_float, aux = saved
    d_x, d_cache_float, _, _ = cotangents  # the cache's integers and the routes: none
    # The recomputation's inputs are made to depend on the cotangent: a zero computed from it
    # (XLA does not fold x * 0 for floats) is added to every saved input and parameter.
    state, x_BxTxD, cache_float = _after(d_x, (state, x_BxTxD, cache_float))
    _, vjp = jax.vjp(
        lambda s, x, c: _remat_call(graphdef, s, x, c, aux)[:2], state, x_BxTxD, cache_float
    )
    d_state, d_x, d_cache_in = vjp((d_x, d_cache_float))
    return d_state, d_x, d_cache_in, None


_remat_apply.defvjp(_remat_fwd, _remat_bwd)
