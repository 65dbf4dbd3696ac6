"""Multi-LoRA as vllm_backend does it: `model.json` with `enable_lora` and
`multi_lora.json` (adapter name -> PEFT adapter directory) in a model's version
directory; a request picks one with `sampling_parameters.lora_name`.

`a3b-render --lora NAME=DIR` writes both files for `a3b_llm` (which serves the
adapters) and `ensemble` (where Triton's OpenAI frontend looks up LoRA names).
This module reads and writes them without torch; a3b_backend/serving/adapters.py
prepares the listed adapters for the engine.
"""
from __future__ import annotations

import json
from pathlib import Path

MODEL_JSON = "model.json"
MULTI_LORA_JSON = "multi_lora.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT names an adapter tensor base_model.model.<module>.lora_A.weight
PEFT_PREFIX, LORA_A_SUFFIX, LORA_B_SUFFIX = "base_model.model.", ".lora_A.weight", ".lora_B.weight"


class AdapterError(ValueError):
    """A listed adapter cannot be served (missing, wrong format, over the profile's limits)."""


def write_config(version_dir: Path, adapters: dict[str, Path]) -> list[Path]:
    """model.json + multi_lora.json enabling these adapters (absolute paths); none: both removed."""
    files = [version_dir / MODEL_JSON, version_dir / MULTI_LORA_JSON]
    if not adapters:
        for path in files:
            path.unlink(missing_ok=True)
        return []
    version_dir.mkdir(parents=True, exist_ok=True)
    files[0].write_text(json.dumps({"enable_lora": "true"}, indent=1) + "\n")
    files[1].write_text(json.dumps({name: str(path.resolve()) for name, path in adapters.items()}, indent=1) + "\n")
    return files


def read_config(version_dir: Path, project_root: Path) -> dict[str, Path]:
    """The adapters a version directory enables (relative paths against the project root); {} when LoRA is off."""
    model_json = version_dir / MODEL_JSON
    if not model_json.exists() or str(json.loads(model_json.read_text()).get("enable_lora")).lower() != "true":
        return {}
    listed = version_dir / MULTI_LORA_JSON
    if not listed.exists():
        raise AdapterError(f"{model_json} enables LoRA but {listed} is missing (adapter name -> directory)")
    entries = json.loads(listed.read_text())
    if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
        raise AdapterError(f"{listed} must be a JSON object of adapter name -> directory")
    return {name: path if path.is_absolute() else project_root / path
            for name, path in ((n, Path(p)) for n, p in entries.items())}


def adapter_rank(adapter_dir: Path) -> int:
    """The largest rank of a PEFT adapter (its `r`, or a larger per-module one)."""
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
