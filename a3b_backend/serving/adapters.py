"""A calibrated A3B checkpoint has AWQ scales folded into its RMSNorms and its
up_proj rows, so the linears that read those norms (q/k/v, gate/up, Gated
DeltaNet's input projections, MoE routers and experts) and the down projections
read their input divided by a per-channel scale, and up_proj gives its output
divided by the down_proj's. An adapter trained on the source model expects the undivided
input and gives the undivided output; its A matrices are multiplied by the
input scales (A s . x/s = A x) and up_proj's B rows divided by the row
divisors into a copy the engine loads, so adapters work unchanged on the
quantized model.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from a3b_backend.quant.checkpoint import INPUT_SCALES_FILE, ROW_DIVISORS_FILE
from a3b_backend.serving.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_A_SUFFIX, LORA_B_SUFFIX, PEFT_PREFIX,
                                      AdapterError, adapter_rank)
from a3b_backend.serving.tensors import RequestError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


ROUTED_INPUT = re.compile(r"(?<=\.experts)\.\d+\.(gate_proj|up_proj)$")


def fold_scales(src: Path, dst: Path, scales: dict[str, torch.Tensor],
                row_divisors: dict[str, torch.Tensor]) -> int:
    """Copy an adapter with each scaled module's A multiplied by its input scale and each
    row-divided module's B rows divided by its divisors; -> tensors changed."""
    weights = load_file(src / ADAPTER_WEIGHTS)
    changed = 0
    for key, tensor in weights.items():
        module = key.removeprefix(PEFT_PREFIX).removesuffix(LORA_A_SUFFIX).removesuffix(LORA_B_SUFFIX)
        # routed experts' gate/up share one scale, recorded under their experts module
        scale = scales.get(module, scales.get(ROUTED_INPUT.sub("", module)))
        if key.endswith(LORA_A_SUFFIX) and scale is not None:
            weights[key] = (tensor.float() * scale).to(tensor.dtype)
            changed += 1
        elif key.endswith(LORA_B_SUFFIX) and module in row_divisors:
            weights[key] = (tensor.float() / row_divisors[module][:, None]).to(tensor.dtype)
            changed += 1
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / ADAPTER_CONFIG, dst / ADAPTER_CONFIG)
    save_file(weights, dst / ADAPTER_WEIGHTS)
    return changed


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The served adapters: name -> directory the engine loads."""

    paths: dict[str, Path]

    @classmethod
    def prepare(cls, listed: dict[str, Path], model_dir: Path, work_dir: Path, max_rank: int) -> "Adapters":
        """Check every listed adapter against the profile's limits; fold the checkpoint's input scales in."""
        scales_file, divisors_file = model_dir / INPUT_SCALES_FILE, model_dir / ROW_DIVISORS_FILE
        scales = load_file(scales_file) if scales_file.exists() else {}
        # a checkpoint converted before down_proj's scales were folded has none
        row_divisors = load_file(divisors_file) if divisors_file.exists() else {}
        quantization = json.loads((model_dir / "config.json").read_text()).get("quantization_config", {})
        if listed and quantization.get("calibrated") and not scales:
            raise AdapterError(f"{model_dir} was calibrated but has no {INPUT_SCALES_FILE} (converted by an older "
                               "a3b-quantize): LoRA adapters would read scaled inputs; convert it again")
        paths = {}
        for name, path in listed.items():
            if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
                raise AdapterError(f"LoRA adapter '{name}': {path} is not a PEFT adapter directory "
                                   f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} are needed)")
            rank = adapter_rank(path)
            if rank > max_rank:
                raise AdapterError(f"LoRA adapter '{name}' has rank {rank}; the profile allows at most "
                                   f"{max_rank} (max_lora_rank)")
            if scales:
                fold_scales(path, work_dir / name, scales, row_divisors)
                path = work_dir / name
            paths[name] = path
        return cls(paths)

    def request(self, name: str | None) -> "LoRARequest | None":
        """The engine's LoRARequest for a request's lora_name (None: the base model)."""
        from vllm.lora.request import LoRARequest

        if name is None:
            return None
        if not self.paths:
            raise RequestError(f"parameter 'lora_name' = {name!r}: no LoRA adapters are served "
                               f"(enable them with a3b-render --lora NAME=DIR)")
        if name not in self.paths:
            raise RequestError(f"parameter 'lora_name' = {name!r} is not a served adapter; known: "
                               f"{', '.join(sorted(self.paths))}")
        # vLLM tells adapters apart by a positive integer id
        return LoRARequest(name, list(self.paths).index(name) + 1, str(self.paths[name]))
