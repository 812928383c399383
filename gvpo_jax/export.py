"""Export: a run's policy as a Hugging Face directory (model + tokenizer) that transformers
loads; a LoRA policy merged, and its adapters alone in PEFT's format."""

from __future__ import annotations

import os

from gvpo_jax import assemble, models, sharding
from gvpo_jax.models import lora


def export(run_: assemble.Run, params) -> dict:
    """The policy as a Hugging Face directory (model + tokenizer) in workdir/export.

    Tensors are written in `train.export_dtype` (default: the compute dtype). A LoRA policy is
    exported merged (W + scale A B, summed in fp32) there, and its adapters alone in PEFT's
    format in workdir/export_adapter (adapters on MoE experts, `lora.experts`, only in the
    merged model: `lora.save_peft` says so). Returns {"export_dir"[, "adapter_dir"]}.
    """
    out = os.path.join(run_.workdir, "export")
    c = run_.config
    dtype = c.train.export_dtype or c.model.compute_dtype
    host = sharding.gather(params)  # an all-gather in multi-process runs: every process calls
    result = {"export_dir": out}
    if sharding.is_primary():
        model = run_.model(host)
        if run_.lora is not None:
            result["adapter_dir"] = os.path.join(run_.workdir, "export_adapter")
            lora.save_peft(model, result["adapter_dir"], run_.lora, base_model=c.model.hf_dir)
            model = lora.merged(model, dtype)
        models.save_pretrained(model, out, dtype=dtype)
        run_.tokenizer.save_pretrained(out)
        print(f"Exported the policy to {out}")
    return result
