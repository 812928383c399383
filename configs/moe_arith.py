"""A small mixture-of-experts policy learns addition from scratch: the demo's recipe
(configs/arith_tiny.py: SFT, then GVPO on exact-match reward) with a Qwen3-MoE model.

    python -m gvpo_jax.main --config=configs/moe_arith.py --workdir=runs/moe_arith

No pretrained MoE is reachable offline, so the model starts random: 3 Qwen3-MoE layers (QK-norm,
no attention bias) of 8 SwiGLU experts of width 96, each token routed to its top 2
(renormalised), dropless. Its active MLP width per token (2 x 96 = 192) is half the demo's
dense 384; `--config.model.overrides.num_experts=1 --config.model.overrides.num_experts_per_tok=1
--config.model.overrides.moe_intermediate_size=192` is the dense model of the same active size.
Besides the demo's metrics every RL step logs the routing: moe/routing_drift (the share of
(token, layer) pairs whose experts changed between the sampler and the update's start, read
from the first update's forward),
moe/load_max_over_mean (the busiest expert's share x E, per layer) and moe/router_entropy.
The router's load-balancing loss is off, as in the peers' RL recipes (docs/models.md).
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "arith_tiny", os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith_tiny.py")
)
_arith_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_arith_tiny)


def get_config():
    c = _arith_tiny.get_config()
    o = c.model.overrides
    o.architecture = "qwen3_moe"  # Qwen3's attention (QK-norm, no bias) + MoE MLPs
    o.qk_norm = True
    o.attention_bias = False
    o.num_experts = 8  # E
    o.num_experts_per_tok = 2  # top-k
    o.moe_intermediate_size = 96  # each expert's SwiGLU width
    o.norm_topk_prob = True  # the k gates renormalised to sum 1 (Qwen3-30B-A3B's setting)
    return c
