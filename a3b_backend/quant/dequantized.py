"""A checkpoint, A3B or float, as a float32 transformers model: A3B weights dequantized, per-expert
or stacked experts, published (`model.language_model.*`) or text-only names. The reference the
parity tests and the fidelity benchmark compare against."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize


def stored_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def float_model(checkpoint: Path) -> torch.nn.Module:
    """transformers' model of the checkpoint's architecture, float32, holding its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_json = json.loads((checkpoint / "config.json").read_text())
    quantization = config_json.pop("quantization_config", None)
    a3b = A3BConfig.from_json(quantization) if quantization else None
    config = AutoConfig.for_model(**config_json)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    stored = stored_tensors(checkpoint)
    published = any(name.startswith("model.language_model.") for name in stored)

    def weight(name: str) -> torch.Tensor:
        if f"{name}_packed" in stored:
            return dequantize(A3BWeight.from_tensors(stored, name), a3b)
        return stored[name].float()

    def experts(base: str, proj: str) -> torch.Tensor:
        if f"{base}.{proj}" in stored:
            return stored[f"{base}.{proj}"].float()
        count = config.num_experts
        if proj == "gate_up_proj":
            return torch.stack([torch.cat([weight(f"{base}.{e}.{half}.weight") for half in ("gate_proj", "up_proj")])
                                for e in range(count)])
        return torch.stack([weight(f"{base}.{e}.down_proj.weight") for e in range(count)])

    # a tied lm_head is the embedding: checkpoints store it once
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    state = {}
    for name in model.state_dict():
        if name in tied:
            continue
        stored_name = name.replace("model.", "model.language_model.", 1) if published and name.startswith("model.") \
            else name
        base, _, proj = stored_name.rpartition(".")
        state[name] = experts(base, proj) if base.endswith("mlp.experts") else weight(stored_name)
    model.load_state_dict(state, strict=not tied)
    if tied:
        model.tie_weights()
    return model
