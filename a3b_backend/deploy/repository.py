"""Renders the model repository's config.pbtxt files from the contract.

The committed configs are this module's output (a test checks they match), so
the four models never disagree. Engine settings are not in the configs: every
model reads them from `profiles.py` at load time, chosen by $A3B_PROFILE.

    a3b-render [--repository model_repository] [--check]
    a3b-render --lora NAME=DIR [--lora NAME=DIR ...]   # serve LoRA adapters
    a3b-render --no-lora                               # stop serving them

LoRA adapters are listed vllm_backend's way (a3b_backend/serving/lora.py) in the
version directories of the LLM model and of `ensemble`; the configs do not
change.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

from a3b_backend import contract
from a3b_backend.contract import Tensor
from a3b_backend.deploy.rendered import write_or_check
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.serving import lora

HEADER = "# Rendered by `a3b-render` from a3b_backend/contract.py; do not edit by hand.\n"


def _tensor_block(kind: str, tensors: Iterable[Tensor]) -> str:
    items = []
    for t in tensors:
        lines = [f'    name: "{t.name}"', f"    data_type: TYPE_{t.dtype}",
                 f"    dims: [ {', '.join(str(d) for d in t.dims)} ]"]
        if t.optional and kind == "input":
            lines.append("    optional: true")
        items.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(items) + "\n]\n"


def _python_model(name: str, inputs, outputs, decoupled: bool, instance_kind: str, count: int) -> str:
    return (
        HEADER
        + f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        + f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}\n"
        + _tensor_block("input", inputs)
        + _tensor_block("output", outputs)
        + f"instance_group [ {{ count: {count}, kind: {instance_kind} }} ]\n"
    )


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    ins = "".join(f'      input_map {{ key: "{k}" value: "{v}" }}\n' for k, v in inputs.items())
    outs = "".join(f'      output_map {{ key: "{k}" value: "{v}" }}\n' for k, v in outputs.items())
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n{ins}{outs}    }}'


def _ensemble() -> str:
    llm_in = {t.name: f"_pre_{t.name}" for t in contract.PREPROCESS_OUTPUTS}
    llm_out = {t.name: f"_llm_{t.name}" for t in contract.LLM_OUTPUTS}
    steps = [
        _step("preprocessing", {t.name: t.name for t in contract.TEXT_INPUTS}, llm_in),
        _step(contract.LLM_MODEL, llm_in, llm_out),
        _step("postprocessing", llm_out, {t.name: t.name for t in contract.TEXT_OUTPUTS}),
    ]
    return (
        HEADER
        + f'name: "{contract.ENSEMBLE_MODEL}"\nplatform: "ensemble"\nmax_batch_size: 0\n'
        + "model_transaction_policy { decoupled: true }\n"
        + _tensor_block("input", contract.TEXT_INPUTS)
        + _tensor_block("output", contract.TEXT_OUTPUTS)
        + "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}\n"
    )


def render() -> dict[str, str]:
    """Model name -> config.pbtxt text."""
    return {
        "preprocessing": _python_model("preprocessing", contract.TEXT_INPUTS, contract.PREPROCESS_OUTPUTS,
                                       decoupled=False, instance_kind="KIND_CPU", count=1),
        # KIND_MODEL: vLLM places the model on its devices itself.
        contract.LLM_MODEL: _python_model(contract.LLM_MODEL, contract.LLM_INPUTS, contract.LLM_OUTPUTS,
                                 decoupled=True, instance_kind="KIND_MODEL", count=1),
        # One instance keeps the pieces of a stream in engine order. No
        # dynamic batching: Triton's batcher answers a cancelled request
        # itself, so postprocessing would never see an ensemble client's
        # cancellation to pass on to a3b_llm (with it,
        # test_cancelled_ensemble_streams_abort_the_engine fails).
        "postprocessing": _python_model("postprocessing", contract.POSTPROCESS_INPUTS, contract.TEXT_OUTPUTS,
                                        decoupled=False, instance_kind="KIND_CPU", count=1),
        contract.ENSEMBLE_MODEL: _ensemble(),
        # One instance: each request is served on a thread of its own (a3b_backend/serving/bls.py).
        contract.BLS_MODEL: _python_model(contract.BLS_MODEL, contract.TEXT_INPUTS, contract.TEXT_OUTPUTS,
                                          decoupled=True, instance_kind="KIND_CPU", count=1),
    }


# Where LoRA names are listed: the model that serves them and the ones clients address.
LORA_MODELS = (contract.LLM_MODEL, contract.ENSEMBLE_MODEL, contract.BLS_MODEL)


def lora_entry(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    if not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"adapter directory {path} of {name!r} does not exist")
    return name, Path(path)


def write_lora(repository: Path, adapters: dict[str, Path]) -> None:
    for model in LORA_MODELS:
        for path in lora.write_config(repository / model / "1", adapters):
            print(f"wrote {path}")
    if not adapters:
        print(f"LoRA off: removed {lora.MODEL_JSON} / {lora.MULTI_LORA_JSON} under {repository}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=PROJECT_ROOT / "model_repository")
    parser.add_argument("--check", action="store_true", help="fail if a committed config differs from the rendered one")
    lora_group = parser.add_mutually_exclusive_group()
    lora_group.add_argument("--lora", type=lora_entry, action="append", metavar="NAME=DIR",
                            help="serve this PEFT adapter under NAME (repeat for more)")
    lora_group.add_argument("--no-lora", action="store_true", help="serve no LoRA adapters")
    args = parser.parse_args(argv)
    if args.lora or args.no_lora:
        write_lora(args.repository, dict(args.lora or []))
    configs = {args.repository / model / "config.pbtxt": text for model, text in render().items()}
    stale = write_or_check(configs, args.check)
    if stale:
        print("stale configs (run a3b-render): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
