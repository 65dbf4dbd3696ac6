"""a3b-quantize: HF safetensors checkpoint -> A3B checkpoint, one decoder layer at a time.

    a3b-quantize SRC_DIR DST_DIR [--block-shape R C] [--calibration-text FILE | --calibration-chat]
                 [--calibration-tokens N] [--rounding nearest|gptq] [--tune-epochs N]
                 [--device cuda] [--expert-tokens routed|all] [--tune-steps N [--tune-inputs float|quantized]]
    a3b-quantize SRC_DIR DST_DIR --uncalibrated [--block-shape R C]

Linear weights of the decoder layers (attention, MLP, MoE experts, shared
experts, Gated DeltaNet projections) become A3B tensors; embeddings, norms,
lm_head, MoE routers, the multi-token-prediction layer (`mtp.*`), a vision
tower and everything else are copied as they are. Routed experts stored
stacked (Qwen3.5/3.6's `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I]) are written per expert
(`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`), the layout vLLM's
expert loaders and the `a3b` MoE method read.

One pipeline for every model, from SmolLM2-135M to Qwen3.6-35B-A3B
(a3b_backend/quant/sequential.py): one decoder layer in memory at a time,
resumable after an interruption. Over the first --calibration-tokens (65,536)
tokens of --calibration-text FILE, or of the built-in varied text (the licence
texts, and the installed Python packages' READMEs and docstring prose,
calibrate.broad_calibration_text(); its sha256 follows the installed packages
and is recorded in the checkpoint's config), each layer is run for activation
statistics: importance-weighted fits, AWQ scales (alpha searched per layer
group) where they fold into an RMSNorm, and for each MLP's down_proj, folded
into its up_proj's rows. Folding divides those layers' inputs by the scale, so
the scales are kept (`INPUT_SCALES_FILE`, per linear, and `ROW_DIVISORS_FILE`,
per up_proj): a LoRA adapter trained on the source model reads them to see the
inputs and give the outputs it was trained on (a3b_backend/serving/lora.py).
The codes are chosen by error-compensating rounding (GPTQ's column order on
each linear's input Hessian, a3b_backend/quant/gptq.py; routed experts each on
their own tokens where they saw enough, a3b_backend/quant/experts.py);
--rounding nearest keeps each fitted table's nearest entry. Then the quantized
linears' metadata and the norms' AWQ scales are tuned end to end against the
source model over the same text, one layer built at a time (--tune-epochs
passes, default 1; 0 skips it; a3b_backend/quant/stream_tune.py); --tune-steps
tunes each layer's dense linears' rounding and metadata block-wise first
(AutoRound's recipe, a3b_backend/quant/block_tune.py; off by default).
--uncalibrated writes each linear's nearest rounding on its own weights,
tensor by tensor, with no model run (much worse; for tests and comparisons).

The result is written to DST_DIR.partial and renamed to DST_DIR only when
complete, so a failed run never leaves a checkpoint that looks whole.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Literal, get_args

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from a3b_backend.quant import calibrate, checkpoint
from a3b_backend.quant.checkpoint import COPIED_FILES, INPUT_SCALES_FILE, ROW_DIVISORS_FILE
from a3b_backend.quant.format import (A3BConfig, A3BWeight, QuantizationError, dequantize, gpu_block_problem,
                                      quantize)
from a3b_backend.quant.gptq import quantize_gptq
from a3b_backend.quant.names import OUTSIDE_TEXT_MODEL, LayoutError, layout_of
from a3b_backend.quant.block_tune import BlockTuneConfig, TuneInputs
from a3b_backend.quant.tune import TuneConfig

KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
# Experts stored stacked as 3-D tensors [experts, out, in] in some checkpoints.
STACKED_EXPERTS = re.compile(r"\.layers\.\d+\..*experts\.(gate_up_proj|gate_proj|up_proj|down_proj)$")
# Qwen3.5/3.6 (and Qwen3-Next) RMSNorms are zero-centred: they scale by (1 + w).
ZERO_CENTRED_NORMS = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text", "qwen3_next")


class ConversionError(ValueError):
    pass


# nearest: every weight to its block table's nearest entry; gptq: codes chosen in
# column order with each column's error pushed onto the rest (a3b_backend/quant/gptq.py)
Rounding = Literal["nearest", "gptq"]


@dataclasses.dataclass(frozen=True)
class LinearCalibration:
    importance: torch.Tensor  # per input channel, E[x^2]
    scale: torch.Tensor | None = None  # AWQ scale folded into what produces the input (an RMSNorm or up_proj)
    hessian: torch.Tensor | None = None  # E[x x^T], for gptq rounding
    row_divisor: torch.Tensor | None = None  # up_proj: the next down_proj's AWQ scale, divided out of its rows

    def scaled(self, weight: torch.Tensor) -> tuple[torch.Tensor, "LinearCalibration"]:
        """The weight the checkpoint stores and the statistics of the inputs it then reads (x / scale)."""
        if self.row_divisor is not None:
            weight = weight / self.row_divisor[:, None]
        if self.scale is None:
            return weight, self
        s = self.scale
        hessian = None if self.hessian is None else self.hessian / (s[:, None] * s[None, :])
        return weight * s, LinearCalibration(self.importance / s**2, None, hessian)

    def source(self, stored: torch.Tensor) -> torch.Tensor:
        """A stored weight (`scaled`'s) in the source's scale."""
        weight = stored if self.scale is None else stored / self.scale
        return weight if self.row_divisor is None else weight * self.row_divisor[:, None]


def check_paths(src: Path, dst: Path) -> dict:
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src} is not an HF checkpoint: config.json is missing")
    if not sorted(src.glob("*.safetensors")):
        found = ", ".join(p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".gguf")) or "none"
        raise ConversionError(f"{src} has no .safetensors weights (found: {found}); only safetensors are read")
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r or src_r in dst_r.parents or dst_r in src_r.parents:
        raise ConversionError(f"destination {dst} would overwrite or nest inside the source {src}")
    if dst.exists() and any(dst.iterdir()):
        raise ConversionError(f"destination {dst} exists and is not empty; remove it or choose another")
    config = json.loads((src / "config.json").read_text())
    model_type = config.get("model_type", "?")
    if model_type not in KNOWN_MODEL_TYPES:
        raise ConversionError(
            f"architecture '{model_type}' ({config.get('architectures')}) is unknown to the converter: it cannot "
            f"tell which tensors are linear layers; known: {', '.join(KNOWN_MODEL_TYPES)}"
        )
    if "quantization_config" in config:
        raise ConversionError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    return config


def calibration_ids(src: Path, text_path: Path, tokens: int) -> torch.Tensor:
    """The first `tokens` tokens of the calibration text, in the model's own tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(src).encode(calibrate.load_text(text_path))
    if len(ids) < tokens:
        raise ConversionError(f"calibration text {text_path} is {len(ids)} tokens; --calibration-tokens asks for "
                              f"{tokens}: give a longer text or ask for at most {len(ids)}")
    return torch.tensor(ids[:tokens])


def calibration_record(text_path: Path, tokens: int, experts_on_fallback: int) -> dict:
    """What a calibrated checkpoint's config records of its calibration: the text by name (the file's;
    the built-in ones are BUILT_IN_FILES) and by content (its sha256)."""
    return {"calibration_text": text_path.name,
            "calibration_text_sha256": hashlib.sha256(text_path.read_bytes()).hexdigest(),
            "calibration_tokens": tokens, "experts_on_fallback": experts_on_fallback}


def quantization_config(config: A3BConfig, rounding: Rounding, tuned_epochs: int, calibration: dict | None,
                        **extra) -> dict:
    """A converted checkpoint's `quantization_config` (`calibration`: `calibration_record`'s, None uncalibrated)."""
    return {**config.to_json(), "calibrated": calibration is not None, "rounding": rounding,
            "tuned_epochs": tuned_epochs, "quantized_layers": calibrate.QUANTIZED.pattern, **(calibration or {}),
            **extra}


def folded_scales(linears: dict[str, LinearCalibration]) -> dict[str, dict[str, torch.Tensor]]:
    """The AWQ scales folded into the checkpoint by kind ("scale", "row_divisor") and module (the LoRA fold
    reads them)."""
    return {field: {module: getattr(c, field) for module, c in linears.items() if getattr(c, field) is not None}
            for field in ("scale", "row_divisor")}


def write_side_files(src: Path, partial: Path, model_config: dict, quantization: dict,
                     scales: dict[str, dict[str, torch.Tensor]]) -> None:
    """What a converted checkpoint holds besides its weights: config.json, the folded scales, the tokenizer's files."""
    (partial / "config.json").write_text(json.dumps({**model_config, "quantization_config": quantization}, indent=2))
    for path, field in ((INPUT_SCALES_FILE, "scale"), (ROW_DIVISORS_FILE, "row_divisor")):
        if scales[field]:
            (partial / path).parent.mkdir(exist_ok=True)
            # clones: the linears of one norm share its scale, and safetensors refuses shared storage
            save_file({m: s.clone() for m, s in scales[field].items()}, partial / path)
    for fname in COPIED_FILES:
        if (src / fname).exists():
            shutil.copy2(src / fname, partial / fname)


def awq_calibration(stats: dict[str, calibrate.ChannelStats], weights: dict[str, torch.Tensor], config: A3BConfig,
                    progress: bool = True) -> tuple[dict[str, LinearCalibration], dict[str, torch.Tensor]]:
    """Per-linear calibration from statistics, with the AWQ scales searched for each RMSNorm's group
    and each MLP's down_proj (weights: the linears' float weights by module name); and the norms' scales."""
    def quant_dequant(_name, w, importance):
        return dequantize(quantize(w, config, col_importance=importance), config)

    per_linear = {name: LinearCalibration(st.importance, hessian=None if st.gram is None else st.hessian)
                  for name, st in stats.items()}
    per_norm = {}
    for norm, members in tqdm(calibrate.groups(list(stats)).items(), desc="searching AWQ scales", unit="group",
                              disable=not progress):
        scale = calibrate.choose_scale({m: weights[m] for m in members}, stats[members[0]], quant_dequant)
        per_norm[norm] = scale
        per_linear.update({m: dataclasses.replace(per_linear[m], scale=scale) for m in members})
    for down, up in tqdm(calibrate.row_folds(list(stats)).items(), desc="searching down_proj AWQ scales",
                         unit="layer", disable=not progress):
        scale = calibrate.choose_scale({down: weights[down]}, stats[down], quant_dequant)
        per_linear[down] = dataclasses.replace(per_linear[down], scale=scale)
        per_linear[up] = dataclasses.replace(per_linear[up], row_divisor=scale)
    return per_linear, per_norm


def quantize_linear(name: str, tensor: torch.Tensor, config: A3BConfig,
                    calibration: dict[str, LinearCalibration], module: str | None = None) -> A3BWeight:
    """`module`: the loaded model's name for the linear (default: the checkpoint's, `name` without
    `.weight`). A linear calibration gave no statistics is refused, never written as calibrated."""
    module = module or name.removesuffix(".weight")
    found = calibration.get(module)
    if found is None:
        raise ConversionError(f"calibration gave no statistics for the linear {name} (module {module} of the "
                              f"loaded model): the checkpoint's names and the model's do not meet")
    w, stats = found.scaled(tensor.float())
    if stats.hessian is not None:
        return quantize_gptq(w, config, stats.hessian, name=name)
    return quantize(w, config, col_importance=stats.importance, name=name)


def per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked experts tensor [E, out, in] as per-expert `.weight`s; gate_up_proj is
    [gate; up] along out, as transformers' Qwen experts compute it."""
    experts, proj = name.rsplit(".", 1)
    halves = {"gate_up_proj": ("gate_proj", "up_proj")}.get(proj)
    out = {}
    for e in range(tensor.shape[0]):
        parts = tensor[e].chunk(2, dim=0) if halves else (tensor[e],)
        out.update({f"{experts}.{e}.{p}.weight": w for p, w in zip(halves or (proj,), parts)})
    return out


def fold_norm_scale(norm: torch.Tensor, scale: torch.Tensor, zero_centred: bool) -> torch.Tensor:
    """The RMSNorm weight that divides its output by `scale` (the AWQ scale's inverse):
    w / s, or for a zero-centred norm (output x_hat * (1 + w)) (1 + w) / s - 1."""
    w = norm.float()
    return ((1 + w) / scale - 1 if zero_centred else w / scale).to(norm.dtype)


def convert_tensor(name: str, tensor: torch.Tensor, config: A3BConfig) -> tuple[dict[str, torch.Tensor], int]:
    """A checkpoint tensor, uncalibrated -> (output tensors, number of weights quantized)."""
    checkpoint_module = name.removesuffix(".weight")
    if tensor.ndim == 3 and STACKED_EXPERTS.search(name) and not OUTSIDE_TEXT_MODEL.match(name):
        out, count = {}, 0
        for expert_name, weight in per_expert(name, tensor).items():
            tensors, n = convert_tensor(expert_name, weight, config)
            out.update(tensors)
            count += n
        return out, count
    if name.endswith(".weight") and tensor.ndim == 2 and calibrate.is_quantized(checkpoint_module):
        return quantize(tensor.float(), config, name=name).tensors(name), tensor.numel()
    return {name: tensor}, 0


def convert(src: Path, dst: Path, config: A3BConfig) -> Path:
    """`--uncalibrated`: each linear to its nearest rounding on its own weights, one shard at a time."""
    model_config = check_paths(src, dst)
    shards = sorted(src.glob("*.safetensors"))
    try:
        layout_of(name for shard in shards for name in _names(shard))  # a checkpoint of a known layout
    except LayoutError as exc:
        raise ConversionError(f"{src}: {exc}") from None
    with checkpoint.building(dst) as partial:
        index, total, quantized_weights, linears = {}, 0, 0, 0
        with tqdm(total=sum(len(_names(s)) for s in shards), desc="quantizing", unit="tensor") as bar:
            for shard in shards:
                out: dict[str, torch.Tensor] = {}
                with safe_open(shard, "pt") as f:
                    for name in f.keys():
                        tensors, n = convert_tensor(name, f.get_tensor(name), config)
                        out.update(tensors)
                        quantized_weights += n
                        bar.update()
                linears += sum(k.endswith("_packed") for k in out)
                save_file(out, partial / shard.name, metadata={"format": "pt"})
                index.update({k: shard.name for k in out})
                total += sum(t.numel() * t.element_size() for t in out.values())
        if quantized_weights == 0:
            raise ConversionError(f"no linear layer of {src} matched the A3B layer pattern; nothing was quantized")
        if len(shards) > 1:
            (partial / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
        write_side_files(src, partial, model_config, quantization_config(config, "nearest", 0, None),
                         folded_scales({}))
    print(f"{dst}: {linears} linears quantized ({quantized_weights / 1e6:.1f} M weights), uncalibrated")
    return dst


def _names(shard: Path) -> list[str]:
    with safe_open(shard, "pt") as f:
        return list(f.keys())


# 128 windows of 512: the budget llm-compressor's examples and `make compare-quant` calibrate on.
DEFAULT_CALIBRATION_TOKENS = 128 * 512
BUILT_IN_TEXT = "calibrate.broad_calibration_text()"
# The built-in text's file names, by rendering: what a checkpoint's `calibration_text` records
BUILT_IN_FILES = {"plain": "built-in.txt", "chat": "built-in-as-chat-exchanges.txt"}


@contextlib.contextmanager
def calibration_file(path: Path | None, chat_tokenizer: Path | None = None) -> Iterator[Path]:
    """The calibration text as a file: `path`, or the built-in varied text (the licence texts and the
    installed packages' READMEs and docstring prose) written to a temporary one, with `chat_tokenizer`
    (a model directory) each document as a chat exchange in that model's template."""
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="a3b-calibration-") as tmp:
        built_in = Path(tmp) / BUILT_IN_FILES["plain" if chat_tokenizer is None else "chat"]
        built_in.write_text(calibrate.broad_calibration_text() if chat_tokenizer is None
                            else calibrate.chat_calibration_text(chat_template_tokenizer(chat_tokenizer)),
                            encoding="utf-8")
        yield built_in


def chat_template_tokenizer(src: Path):
    """The source model's tokenizer, refused when it has no chat template to render calibration in."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    if not getattr(tokenizer, "chat_template", None):
        raise ConversionError(f"--calibration-chat: the tokenizer in {src} has no chat template")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--block-shape", type=int, nargs=2, metavar=("R", "C"), default=(1, 128))
    parser.add_argument("--cpu-only-blocks", action="store_true",
                        help="allow a block shape only the CPU kernels run (the GPU kernels need 1 x 2^n, n >= 7)")
    parser.add_argument("--iterations", type=int, default=A3BConfig.iterations)
    calibration = parser.add_mutually_exclusive_group()
    calibration.add_argument("--calibration-text", type=Path,
                             help=f"text file for activation-aware calibration (default: the built-in varied text, "
                                  f"{BUILT_IN_TEXT}: the licence texts, and the installed Python packages' "
                                  "READMEs and docstring prose)")
    calibration.add_argument("--uncalibrated", action="store_true",
                             help="no calibration: nearest rounding on each block's own weights (much worse)")
    parser.add_argument("--calibration-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS)
    parser.add_argument("--calibration-chat", action="store_true",
                        help="the built-in text's documents each as one exchange in the source model's chat "
                             "template (its first line asked, the rest answered), so calibration also covers "
                             "a chat model's answers")
    parser.add_argument("--rounding", choices=get_args(Rounding),
                        help="gptq (the default with calibration): error-compensating rounding in column "
                             "order; nearest (the only choice with --uncalibrated)")
    parser.add_argument("--tune-epochs", type=int,
                        help=f"passes over the calibration text tuning the metadata end to end, one layer in memory "
                             f"at a time (a3b_backend/quant/stream_tune.py; default {TuneConfig.epochs}); 0: none")
    parser.add_argument("--tune-steps", type=int,
                        help="steps per layer tuning its rounding and metadata block-wise, AutoRound's recipe "
                             "(a3b_backend/quant/block_tune.py; AutoRound takes 200); default 0, none: on SmolLM2 "
                             "it never beat the error-compensating rounding on held-out windows")
    parser.add_argument("--tune-inputs", choices=get_args(TuneInputs),
                        help=f"with --tune-steps: tune each layer on the float chain's hidden states or on the "
                             f"quantized layers' outputs passed on (default {BlockTuneConfig.inputs})")
    parser.add_argument("--device", default="cpu",
                        help="where each layer is calibrated, rounded and tuned, cpu or cuda[:N] (default cpu)")
    parser.add_argument("--expert-tokens", choices=("routed", "all"), default="routed",
                        help="each routed expert's statistics from the tokens the model routes to it (default), "
                             "or from every token, as if all were routed to it (statistics only)")
    parser.add_argument("--pipeline", choices=("layers",),
                        help="the one pipeline, one decoder layer at a time (accepted so that commands naming it "
                             "still run; the whole-model pipeline, `model`, was removed: docs/quantization.md)")
    args = parser.parse_args(argv)
    try:
        config = A3BConfig(args.block_shape[0], args.block_shape[1], iterations=args.iterations)
        problem = gpu_block_problem(config.block)
        if problem and not args.cpu_only_blocks:
            raise ConversionError(f"--block-shape: {problem}; --cpu-only-blocks writes it for the CPU kernels alone")
        if args.calibration_chat and (args.calibration_text or args.uncalibrated):
            raise ConversionError("--calibration-chat renders the built-in text; it cannot take "
                                  f"{'--calibration-text' if args.calibration_text else '--uncalibrated'}")
        if args.tune_epochs is not None and args.tune_epochs < 0:
            raise ConversionError(f"--tune-epochs {args.tune_epochs}: allowed are 0 (no tuning) or more")
        if args.tune_steps is not None and args.tune_steps < 0:
            raise ConversionError(f"--tune-steps {args.tune_steps}: allowed are 0 (no tuning) or more")
        if args.tune_inputs is not None and not args.tune_steps:
            raise ConversionError(f"--tune-inputs {args.tune_inputs} chooses what --tune-steps N tunes on: give "
                                  "--tune-steps N > 0 with it")
        if args.uncalibrated:
            calibrated_only = [flag for flag, given in (
                ("--calibration-tokens", args.calibration_tokens != DEFAULT_CALIBRATION_TOKENS),
                ("--rounding gptq", args.rounding == "gptq"), ("--tune-epochs", args.tune_epochs),
                ("--tune-steps", args.tune_steps), ("--device", args.device != "cpu"),
                ("--expert-tokens", args.expert_tokens != "routed")) if given]
            if calibrated_only:
                raise ConversionError(f"--uncalibrated runs no model, so it cannot take {', '.join(calibrated_only)}"
                                      f": the tuning and error-compensating rounding need calibration")
            convert(args.src, args.dst, config)
        else:
            from a3b_backend.quant.sequential import convert_layers

            with calibration_file(args.calibration_text, args.src if args.calibration_chat else None) as text:
                convert_layers(args.src, args.dst, config, text, args.calibration_tokens, args.rounding or "gptq",
                               BlockTuneConfig(**({} if args.tune_steps is None else {"steps": args.tune_steps}),
                                               inputs=args.tune_inputs or BlockTuneConfig.inputs), args.device,
                               args.expert_tokens == "all",
                               TuneConfig() if args.tune_epochs is None else TuneConfig(epochs=args.tune_epochs))
    except (ConversionError, QuantizationError) as exc:
        print(f"a3b-quantize: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
