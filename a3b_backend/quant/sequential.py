"""Layer-sequential calibration and conversion (`a3b-quantize`'s one pipeline): the model
converted one decoder layer at a time, in the memory of one layer plus the calibration
activations, in the order llm-compressor's sequential pipeline, AutoRound and GPTQModel use.

1. The model's skeleton is built on the meta device (no weights). The embedding alone is
   read from the checkpoint and the calibration windows embedded; one pass with every
   decoder layer replaced by a recorder keeps what the model hands each layer per window
   (rotary cos/sin, masks, positions).
2. Each decoder layer in turn: its tensors are read from the shards one at a time; the
   cached hidden states run through it while its linears', MoE block's and routed experts'
   statistics are recorded; AWQ scales are searched and every linear rounded; the dense
   linears' rounding and metadata are tuned block-wise (quant/block_tune.py, AutoRound's
   recipe: the layer's output against the float layer's on the float chain, --tune-steps
   sign-SGD steps, the best held-out iteration kept); the layer's tensors go to a shard of
   their own and it takes its quantized weights. The next layer's inputs: tuned on the float
   chain (--tune-inputs float), the float layer's outputs; otherwise the windows run through
   the quantized layer again (as llm-compressor does by default), and when tuned on those
   (--tune-inputs quantized) the float chain is carried beside them. Then the layer is freed.
   Routed experts are rounded in groups on their own tokens (quant/experts.py) and keep their
   fitted metadata.
3. With --tune-epochs N (a3b-quantize's default 1), the converted layers are tuned end to end against the source, one layer
   built at a time (quant/stream_tune.py): the float chain is carried beside the quantized one
   through step 2 for its last hidden states, the teacher's.
4. The rest (embedding, final norm, lm_head, an MTP layer, a vision tower) is copied as stored.

Resumable: after each layer, DST.partial holds its shard, the hidden states (both chains
when two are carried) and the progress; the same command after an interruption continues with the next layer,
or with the end-to-end tuning from its last evaluation.

--device cuda runs step 2 on a GPU: the layer, its windows' hidden states and call arguments
are moved there, what the step allocates goes there (a torch.device context), and the
hidden states come back to the host after each layer (they are saved for resuming).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils._pytree import tree_map_only
from tqdm import tqdm

from a3b_backend.quant import calibrate, checkpoint, stream_tune
from a3b_backend.quant.block_tune import BlockTuneConfig, BlockTuned, tune_block
from a3b_backend.quant.experts import round_experts
from a3b_backend.quant.convert import (ZERO_CENTRED_NORMS, ConversionError, Rounding, awq_calibration,
                                       calibration_ids, calibration_record, check_paths, fold_norm_scale,
                                       folded_scales, quantization_config, quantize_linear, write_side_files)
from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize
from a3b_backend.quant.names import Layout, LayoutError, layout_of
from a3b_backend.quant.tune import TuneConfig

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
PROGRESS, ACTIVATIONS = "progress.json", "activations.pt"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors".format
LAYER_SHARD = "layer-{:05d}.safetensors.part".format  # a layer's shard until the conversion is complete
SCALES_SHARD = ".scales-{:05d}.safetensors".format  # a layer's folded AWQ scales until _finish gathers them
# tuned end to end, written beside the untuned ones the tuning reads until _finish puts them in their place
TUNED_SHARD, TUNED_SCALES = "layer-{:05d}.tuned.safetensors.part".format, ".scales-{:05d}.tuned.safetensors".format
REST_SHARD_BYTES = 2**30
# What the conversion measured of itself (per layer: seconds of statistics, rounding, passing on; peak RSS).
REPORT = "a3b/conversion.json"
SEQ_LEN = 512
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclasses.dataclass(frozen=True)
class Source:
    """A safetensors checkpoint read one tensor at a time."""
    path: Path
    layout: Layout
    shard_of: dict[str, Path]
    # tensor names by decoder layer index; None: the rest (embedding, final norm, lm_head, MTP, vision)
    by_layer: dict[int | None, list[str]]

    @classmethod
    def open(cls, path: Path) -> "Source":
        shard_of = {}
        for shard in sorted(path.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                shard_of.update({name: shard for name in f.keys()})
        try:
            layout = layout_of(shard_of)
        except LayoutError as exc:
            raise ConversionError(f"{path}: {exc}") from None
        by_layer: dict[int | None, list[str]] = {None: []}
        for name in shard_of:
            match = LAYER.match(layout.module(name) or "")
            by_layer.setdefault(int(match[1]) if match else None, []).append(name)
        return cls(path, layout, shard_of, by_layer)

    def read(self, name: str) -> torch.Tensor:
        with safe_open(self.shard_of[name], "pt") as f:
            return f.get_tensor(name)

    def nbytes(self, name: str) -> int:
        with safe_open(self.shard_of[name], "pt") as f:
            piece = f.get_slice(name)
            shape, dtype = piece.get_shape(), piece.get_dtype()
        return torch.Size(shape).numel() * SAFETENSORS_BYTES[dtype]


class LayerInputs(torch.nn.Module):
    """Stands in for a decoder layer: keeps what it is called with and passes the hidden states on."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor, tuple, dict]] = []

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((hidden_states, args, kwargs))
        return hidden_states


def skeleton(src: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def layer_inputs(model: torch.nn.Module, source: Source, windows: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[list[tuple[tuple, dict]]], list[torch.nn.Module]]:
    """-> the embedded windows, per layer the arguments the model passes it per window, and
    the model's (meta) layers, taken out of it."""
    decoder = model.get_decoder()
    layers = list(decoder.layers)
    recorders = [LayerInputs() for _ in layers]
    decoder.layers = torch.nn.ModuleList(recorders)
    decoder.norm = torch.nn.Identity()
    embed = decoder.get_input_embeddings()
    embed_name = next(n for n, m in model.named_modules() if m is embed)
    embed.to_empty(device="cpu")
    embed.weight.data = source.read(source.layout.checkpoint(embed_name) + ".weight").float()
    decoder.rotary_emb = type(decoder.rotary_emb)(config=decoder.config)
    with torch.no_grad():
        for ids in windows:
            decoder(input_ids=ids.unsqueeze(0), use_cache=False)
    embed.to("meta")  # needed no more: ~2 GB at Qwen3.6's vocabulary in float32
    hidden = [h for h, _, _ in recorders[0].calls]
    return hidden, [[(args, kwargs) for _, args, kwargs in r.calls] for r in recorders], layers


def load_layer(layer: torch.nn.Module, source: Source, index: int) -> tuple[torch.nn.Module, set[str]]:
    """The (meta) layer with its tensors from the checkpoint in float32 -> (layer, the checkpoint
    names read into its experts). Per-expert tensors are stacked where the module keeps them so."""
    expected = set(layer.state_dict())
    state, per_expert, expert_names = {}, {}, set()
    for name in source.by_layer.get(index, []):
        key = LAYER.match(source.layout.module(name))[2]
        match = PER_EXPERT.match(key)
        if match and f"{match[1]}.gate_up_proj" in expected:
            per_expert.setdefault(match[1], {})[(int(match[2]), match[3])] = name
            expert_names.add(name)
        else:
            state[key] = source.read(name).float()
            if ".experts." in key:
                expert_names.add(name)
    for experts, names in per_expert.items():
        count = 1 + max(e for e, _ in names)
        missing = [f"{experts}.{e}.{p}" for e in range(count) for p in ("gate_proj", "up_proj", "down_proj")
                   if (e, p) not in names]
        if missing:
            raise ConversionError(f"{source.path}: layer {index} lacks expert tensors {missing[:3]}")
        state[f"{experts}.gate_up_proj"] = _stacked(source, [[names[(e, "gate_proj")], names[(e, "up_proj")]]
                                                             for e in range(count)])
        state[f"{experts}.down_proj"] = _stacked(source, [[names[(e, "down_proj")]] for e in range(count)])
    missing = sorted(expected - set(state))
    if missing:
        raise ConversionError(f"{source.path}: layer {index} has no tensor for "
                              + ", ".join(source.layout.checkpoint(f"model.layers.{index}.{k}") for k in missing[:5])
                              + " in its shards")
    # assign: the parameters become these tensors, so the layer is in memory once, not twice
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.requires_grad_(False), expert_names


def _stacked(source: Source, names: list[list[str]]) -> torch.Tensor:
    """float32 [len(names), rows, columns]: entry e the tensors names[e] read and concatenated by
    rows, written in place (a list of the experts, then stacked, would hold the layer's experts twice)."""
    out = None
    for e, parts in enumerate(names):
        row = 0
        for name in parts:
            tensor = source.read(name)
            if out is None:
                out = torch.empty(len(names), tensor.shape[0] * len(parts), tensor.shape[1])
            out[e, row:row + tensor.shape[0]] = tensor
            row += tensor.shape[0]
    return out


def on_device(value, device: torch.device):
    """The tensors anywhere in `value` (a layer's call arguments: rotary cos/sin, masks, positions) on `device`."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def check_device(device: str) -> torch.device:
    """--device as a torch device this host has: the CPU, or a CUDA GPU torch sees."""
    try:
        chosen = torch.device(device)
    except RuntimeError:
        chosen = None
    if chosen is None or chosen.type not in ("cpu", "cuda"):
        raise ConversionError(f"--device {device!r}: allowed are cpu (the default) and cuda or cuda:N")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConversionError(f"--device {device}: torch {torch.__version__} sees no CUDA GPU on this host "
                              f"(built for CUDA: {torch.version.cuda or 'no'}); leave --device out for the CPU")
    if chosen.type == "cuda" and chosen.index is not None and chosen.index >= torch.cuda.device_count():
        raise ConversionError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA GPU(s), "
                              f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return chosen


@torch.no_grad()
def run_layer(layer: torch.nn.Module, hidden: list[torch.Tensor], calls: list[tuple[tuple, dict]]
              ) -> list[torch.Tensor]:
    return [stream_tune.layer_output(layer(h, *args, **kwargs)) for h, (args, kwargs) in zip(hidden, calls)]


@dataclasses.dataclass
class LayerResult:
    tensors: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]  # "scale:<module>" / "row_divisor:<module>": what the LoRA fold reads
    experts_on_fallback: int
    expert_projections_compensated: int  # rounded error-compensating on their own tokens (quant/experts.py)
    expert_projections: int
    seconds: dict[str, float]  # statistics (the layer's forward over the windows), rounding (AWQ search
    # included) and tuning
    float_outputs: list[torch.Tensor] | None = None  # the float layer's outputs on the float chain (tuned, or
    # a float chain carried)
    tuning: BlockTuned | None = None


def quantize_layer(layer: torch.nn.Module, index: int, source: Source, hidden: list[torch.Tensor],
                   calls: list[tuple[tuple, dict]], config: A3BConfig, rounding: Rounding, zero_centred: bool,
                   expert_names: set[str], tune_config: BlockTuneConfig, every_expert: bool = False,
                   float_hidden: list[torch.Tensor] | None = None) -> LayerResult:
    """Calibrates, rounds and tunes one loaded layer on `hidden`; its weights become their quantized
    values (in the source's scale) for the next layer's inputs. Tuned, its targets are the float
    layer's outputs on `float_hidden` (the float chain's inputs), or on `hidden` where that is the
    float chain (None). Given `float_hidden`, the float layer's outputs on it come back, tuned or not."""
    prefix = f"model.layers.{index}."
    started = time.perf_counter()
    routed: dict[str, calibrate.RoutedInputs] = {}
    tuned_here = tune_config.steps > 0
    float_outputs = run_layer(layer, float_hidden, calls) if float_hidden is not None else []

    def run() -> None:
        outputs = run_layer(layer, hidden, calls)
        if tuned_here and float_hidden is None:
            float_outputs.extend(outputs)

    stats = calibrate.record(layer, run, rounding == "gptq", prefix, routed if rounding == "gptq" else None,
                             every_expert)
    recorded = time.perf_counter()
    fallbacks = calibrate.fill_expert_fallbacks(stats, layer, prefix)
    linears = calibrate.quantized_linears(layer, prefix)
    per_linear, per_norm = awq_calibration(stats, {prefix + n: m.weight for n, m in linears.items()}, config,
                                           progress=False)
    out: dict[str, torch.Tensor] = {}

    def store(name: str, q: A3BWeight) -> None:
        """Writes the linear's A3B weight and gives the layer its values in the source's scale."""
        out.update(q.tensors(source.layout.checkpoint(prefix + name) + ".weight"))
        linears[name].weight.data = per_linear[prefix + name].source(dequantize(q, config))

    floats = {name: per_linear[prefix + name].scaled(linear.weight.float())[0] for name, linear in linears.items()
              } if tuned_here else {}  # the tuning's float weights, as the checkpoint scales them
    dense = {name: quantize_linear(source.layout.checkpoint(prefix + name) + ".weight", linear.weight, config,
                                   per_linear, prefix + name) for name, linear in linears.items()}
    for name, q in dense.items():
        store(name, q)
    written = {source.layout.checkpoint(prefix + name) + ".weight" for name in dense}
    readers = {}  # the other readers of a folded norm, by module: their inputs are divided by its scale too
    for module in ({source.layout.module(n.removesuffix(".weight")) for n in source.by_layer[index]}
                   | {prefix + name for name in calibrate.stacked_experts(layer)}):
        if module and calibrate.reads_folded_norm(module) and calibrate.norm_for(module) in per_norm:
            readers[module] = per_norm[calibrate.norm_for(module)]
    compensated = projections = 0
    for name, experts in calibrate.stacked_experts(layer).items():
        group = round_experts(experts, prefix + name, lambda module: source.layout.checkpoint(module) + ".weight",
                              stats, routed.get(prefix + name), config, readers.get(prefix + name))
        out.update(group.tensors)
        compensated += group.error_compensated
        projections += group.projections
    for name in source.by_layer[index]:
        if name in written or name in expert_names:
            continue
        module = source.layout.module(name.removesuffix(".weight"))
        tensor = source.read(name)
        if module in per_norm:
            out[name] = fold_norm_scale(tensor.to(per_norm[module].device), per_norm[module], zero_centred)
        elif module in readers:
            out[name] = (tensor.to(readers[module].device).float() * readers[module]).to(tensor.dtype)
        else:
            out[name] = tensor
    rounded = time.perf_counter()
    tuned = None
    if tuned_here and dense:
        folds = {name: (per_linear[prefix + name].scale, per_linear[prefix + name].row_divisor) for name in dense}

        def run_window(i: int) -> torch.Tensor:
            args, kwargs = calls[i]
            return stream_tune.layer_output(layer(hidden[i], *args, **kwargs))

        tuned = tune_block(layer, dense, floats, config, run_window, float_outputs, folds, tune_config, index)
        for name, q in tuned.weights.items():  # the linears back in their place, with the tuned values
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent), attr, linears[name])
            store(name, q)
    scales = {f"{field}:{module}": scale.to("cpu", copy=True)
              for field, by_module in folded_scales(per_linear).items() for module, scale in by_module.items()}
    scales.update({f"scale:{module}": scale.to("cpu", copy=True) for module, scale in readers.items()})
    seconds = {"statistics": recorded - started, "rounding": rounded - recorded,
               "tuning": time.perf_counter() - rounded}
    return LayerResult({name: tensor.cpu() for name, tensor in out.items()}, scales, fallbacks, compensated,
                       projections, seconds, float_outputs if tuned_here or float_hidden is not None else None, tuned)


def windows_of(src: Path, text_path: Path, tokens: int) -> list[torch.Tensor]:
    """The calibration tokens in windows of SEQ_LEN."""
    ids = calibration_ids(src, text_path, tokens)
    return [ids[start:start + SEQ_LEN] for start in range(0, tokens, SEQ_LEN)]


def fingerprint(src: Path, text_path: Path, tokens: int, config: A3BConfig, rounding: Rounding,
                tune_config: BlockTuneConfig, every_expert: bool = False,
                end_to_end: TuneConfig = TuneConfig(epochs=0)) -> str:
    """What an interrupted run must share with this one for its layers to be kept (not the device:
    a conversion interrupted on a GPU host may go on on the CPU)."""
    digest = hashlib.sha256()
    text = hashlib.sha256(text_path.read_bytes()).hexdigest()
    for part in (str(src.resolve()), (src / "config.json").read_text(), text, tokens,
                 json.dumps(config.to_json()), rounding, json.dumps(dataclasses.asdict(tune_config)),
                 *(["every expert"] if every_expert else []),
                 *([json.dumps(dataclasses.asdict(end_to_end))] if end_to_end.epochs else [])):
        digest.update(str(part).encode())
    return digest.hexdigest()


def check_disk(src: Path, dst: Path) -> None:
    """The output is at most the source's size (4-bit codes replace bf16 weights): refuse to start without it."""
    needed = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    parent = dst.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = os.statvfs(parent).f_bavail * os.statvfs(parent).f_frsize
    if free < needed:
        raise ConversionError(f"{parent} has {free / 2**30:.1f} GiB free; the conversion of {src} needs up to "
                              f"{needed / 2**30:.1f} GiB (the source's size)")


def convert_layers(src: Path, dst: Path, config: A3BConfig, calibration_text: Path, calibration_tokens: int = 2048,
                   rounding: Rounding = "gptq", tune_config: BlockTuneConfig = BlockTuneConfig(), device: str = "cpu",
                   every_expert: bool = False, end_to_end: TuneConfig = TuneConfig(epochs=0)) -> Path:
    target = check_device(device)
    model_config = check_paths(src, dst)
    check_disk(src, dst)
    source = Source.open(src)
    zero_centred = model_config.get("model_type") in ZERO_CENTRED_NORMS
    windows = windows_of(src, calibration_text, calibration_tokens)
    model = skeleton(src)
    hidden, calls, layers = layer_inputs(model, source, windows)
    stamp = fingerprint(src, calibration_text, calibration_tokens, config, rounding, tune_config, every_expert,
                        end_to_end)
    partial = dst.with_name(dst.name + ".partial")
    progress = json.loads((partial / PROGRESS).read_text()) if (partial / PROGRESS).exists() else None
    resume = progress is not None and progress["fingerprint"] == stamp
    if progress is not None and not resume:
        print(f"{partial} holds an interrupted conversion with other inputs; starting over")
    with checkpoint.building(dst, resume=True) as partial:
        if not resume:
            shutil.rmtree(partial)
            partial.mkdir()
            progress = {"fingerprint": stamp, "layers_done": 0, "experts_on_fallback": 0, "layers": []}
        done = progress["layers_done"]
        # The float chain runs beside the quantized one where the block tuning's targets take it as
        # inputs (tuned on quantized inputs) or the end-to-end tuning's teacher ends it; tuned on
        # float inputs, the chain passed on is the float one
        float_chain_is_passed_on = bool(tune_config.steps) and tune_config.inputs == "float"
        float_hidden = ([h.clone() for h in hidden] if not float_chain_is_passed_on
                        and (tune_config.steps or end_to_end.epochs) else None)
        if done:
            print(f"resuming {dst}: layers 0-{done - 1} of {len(layers)} were converted by an earlier run")
            hidden, float_hidden = torch.load(partial / ACTIVATIONS)
        bar = tqdm(range(done, len(layers)), desc="converting layers", unit="layer", initial=done, total=len(layers))
        for index in bar:
            started = time.perf_counter()
            layer, expert_names = load_layer(layers[index], source, index)
            layer.to(target)
            layer_calls, layer_hidden = on_device(calls[index], target), on_device(hidden, target)
            # a torch.device context intercepts every torch call: entered only where allocations must move
            with target if target.type != "cpu" else contextlib.nullcontext():
                result = quantize_layer(layer, index, source, layer_hidden, layer_calls, config, rounding,
                                        zero_centred, expert_names, tune_config, every_expert,
                                        on_device(float_hidden, target))
                passing_on = time.perf_counter()
                if result.float_outputs is not None and float_hidden is None:  # tuned on the float chain
                    hidden = [h.cpu() for h in result.float_outputs]
                else:
                    hidden = [h.cpu() for h in run_layer(layer, layer_hidden, layer_calls)]
                    if float_hidden is not None:
                        float_hidden = [h.cpu() for h in result.float_outputs]
            passed_on = time.perf_counter() - passing_on
            layers[index] = None
            del layer, layer_calls, layer_hidden  # before the next is loaded: one layer in memory at a time
            _trim_heap()
            checkpoint.write_atomic(lambda p: save_file(result.tensors, p, metadata={"format": "pt"}),
                         partial / LAYER_SHARD(index))
            if result.scales:
                checkpoint.write_atomic(lambda p: save_file(result.scales, p), partial / SCALES_SHARD(index))
            checkpoint.write_atomic(lambda p: torch.save((hidden, float_hidden), p), partial / ACTIVATIONS)
            progress["layers_done"] = index + 1
            progress["experts_on_fallback"] += result.experts_on_fallback
            progress["layers"].append({**{k: round(v, 2) for k, v in result.seconds.items()},
                                       "expert_projections": result.expert_projections,
                                       "expert_projections_compensated": result.expert_projections_compensated,
                                       "passing_on": round(passed_on, 2),
                                       "total": round(time.perf_counter() - started, 2),
                                       "peak_rss_gib": round(peak_rss_gib(), 3),
                                       **({"peak_gpu_gib": round(torch.cuda.max_memory_allocated(target) / 2**30, 3)}
                                          if target.type == "cuda" else {}),
                                       **({"block_tuning": result.tuning.to_json()} if result.tuning else {})})
            checkpoint.write_atomic(lambda p: p.write_text(json.dumps(progress)), partial / PROGRESS)
            bar.set_postfix_str(f"peak RSS {peak_rss_gib():.1f} GiB")
            result = None  # its tensors, written
        if end_to_end.epochs and "end_to_end" not in progress:
            started = time.perf_counter()
            progress["end_to_end"] = tune_end_to_end(src, source, partial, config, zero_centred, end_to_end, target,
                                                     windows, float_hidden if float_hidden is not None else hidden)
            progress["end_to_end"]["seconds"] = round(time.perf_counter() - started, 2)
            checkpoint.write_atomic(lambda p: p.write_text(json.dumps(progress)), partial / PROGRESS)
        _finish(source, partial, model_config, config, rounding, tune_config, progress, len(layers),
                calibration_record(calibration_text, calibration_tokens, progress["experts_on_fallback"]),
                every_expert)
    report = json.loads((dst / REPORT).read_text())
    print(f"{dst}: {report['layers']} layers, {report['linears']} linears quantized, each on its own calibration "
          f"statistics; {report['experts_on_fallback']} routed experts took their MoE block's; "
          f"{report['expert_projections_compensated']} of {report['expert_projections']} expert projections rounded "
          f"error-compensating on their own tokens; peak RSS "
          f"{report['peak_rss_gib']:.2f} GiB; {report['seconds_per_layer']:.1f} s per layer ({REPORT})")
    return dst


def final_head(src: Path, source: Source, device: torch.device) -> stream_tune.Head:
    """The model's final norm and lm_head (the embedding where they are tied), read from the source."""
    model = skeleton(src)
    norm, lm_head = model.get_decoder().norm, model.get_output_embeddings()
    names = {module: name for name, module in model.named_modules()}
    stored = {name: source.layout.checkpoint(name) + ".weight" for name in (names[norm], names[lm_head])}
    if stored[names[lm_head]] not in source.shard_of:  # tied
        stored[names[lm_head]] = source.layout.checkpoint(names[model.get_input_embeddings()]) + ".weight"
    for module in (norm, lm_head):
        module.to_empty(device=device)
        weight = source.read(stored[names[module]]).to(device)
        module.weight.data = weight if module is lm_head else weight.float()  # Head makes lm_head's float32
        # not tuned: no gradient for them (lm_head's alone would be a vocabulary x hidden matrix a step)
        module.requires_grad_(False)
    return stream_tune.Head(norm, lm_head)


def tune_end_to_end(src: Path, source: Source, partial: Path, config: A3BConfig, zero_centred: bool,
                    end_to_end: TuneConfig, device: torch.device, windows: list[torch.Tensor],
                    teacher_hidden: list[torch.Tensor]) -> dict:
    """The converted layers' metadata and AWQ norms tuned end to end (quant/stream_tune.py), one layer
    built at a time; the tuned shards and scales are written beside the untuned ones, which _finish
    replaces with them. -> what the checkpoint's config records of it."""
    embedded, calls, meta_layers = layer_inputs(skeleton(src), source, windows)

    def scales(index: int) -> dict[str, torch.Tensor]:
        path = partial / SCALES_SHARD(index)
        return load_file(path) if path.exists() else {}

    layers = stream_tune.ConvertedLayers(load_layer, lambda i: partial / LAYER_SHARD(i), meta_layers, source.layout,
                                         config, zero_centred, scales, end_to_end, device)
    with device if device.type != "cpu" else contextlib.nullcontext():
        tuned = stream_tune.tune_layers(layers, embedded, [on_device(c, device) for c in calls], teacher_hidden,
                                        final_head(src, source, device), end_to_end, partial / stream_tune.STATE)
    if tuned.best_step:
        stream_tune.write_tuned(layers, source.read, lambda i: partial / TUNED_SHARD(i),
                                lambda i: partial / TUNED_SCALES(i))
    return {"epochs": end_to_end.epochs, **tuned.to_json()}


def rest_groups(source: Source, limit: int = REST_SHARD_BYTES) -> list[list[str]]:
    """The tensors outside the decoder layers in groups of at most `limit` bytes (a larger one alone):
    each group is read and written at once, so the embedding and lm_head are never in memory together."""
    groups, size = [[]], 0
    for name in sorted(source.by_layer[None], key=source.nbytes):
        nbytes = source.nbytes(name)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _finish(source: Source, partial: Path, model_config: dict, config: A3BConfig, rounding: Rounding,
            tune_config: BlockTuneConfig, progress: dict, layers: int, calibration: dict, every_expert: bool) -> None:
    groups = rest_groups(source)
    shards = layers + len(groups)
    for group_index, names in enumerate(groups):
        save_file({name: source.read(name) for name in names},
                  partial / SHARD_NAME(layers + group_index + 1, shards), metadata={"format": "pt"})
    for index in range(layers):  # named once the count of the rest's shards is known
        for tuned, untuned in ((TUNED_SHARD(index), LAYER_SHARD(index)), (TUNED_SCALES(index), SCALES_SHARD(index))):
            if (partial / tuned).exists():
                os.replace(partial / tuned, partial / untuned)
        if (partial / LAYER_SHARD(index)).exists():
            (partial / LAYER_SHARD(index)).rename(partial / SHARD_NAME(index + 1, shards))
    weight_map = {}
    for shard in sorted(partial.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            weight_map.update({name: shard.name for name in f.keys()})
    total = sum(p.stat().st_size for p in partial.glob("model-*.safetensors"))
    (partial / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    scales: dict[str, dict[str, torch.Tensor]] = {"scale": {}, "row_divisor": {}}
    for part in sorted(partial.glob(".scales-*.safetensors")):  # the tuned ones are in their place by now
        for key, tensor in load_file(part).items():
            field, module = key.split(":", 1)
            scales[field][module] = tensor
        part.unlink()
    write_side_files(source.path, partial, model_config,
                     quantization_config(config, rounding, progress.get("end_to_end", {}).get("epochs", 0),
                                         calibration, pipeline="layers",
                                         **({"end_to_end_tuning": progress["end_to_end"]}
                                            if "end_to_end" in progress else {}),
                                         **({"tuning": tuning_record(tune_config, progress["layers"])}
                                            if tune_config.steps else {}),
                                         **({"expert_statistics": "every token"} if every_expert else {})), scales)
    linears = sum(1 for name in weight_map if name.endswith("_packed"))
    done = progress["layers"]
    (partial / REPORT).parent.mkdir(exist_ok=True)
    (partial / REPORT).write_text(json.dumps({
        "layers": len(done), "linears": linears, "experts_on_fallback": progress["experts_on_fallback"],
        **{key: sum(d[key] for d in done) for key in ("expert_projections", "expert_projections_compensated")},
        "peak_rss_gib": round(peak_rss_gib(), 3), "seconds_per_layer": sum(d["total"] for d in done) / len(done),
        "per_layer": done}, indent=1))
    for leftover in (PROGRESS, ACTIVATIONS, stream_tune.STATE):
        with contextlib.suppress(FileNotFoundError):
            (partial / leftover).unlink()


def tuning_record(tune_config: BlockTuneConfig, layers: list[dict]) -> dict:
    """What a tuned checkpoint's config says of its block-wise tuning: the settings, and per layer
    the held-out loss before and after and the step kept (0: its untuned weights)."""
    per_layer = [layer["block_tuning"] for layer in layers if "block_tuning" in layer]
    return {"method": "block-wise", **tune_config.to_json(),
            "layers_kept_untuned": sum(1 for t in per_layer if t["best_step"] == 0),
            "held_out_loss": [[t["held_out_before"], t["held_out_after"]] for t in per_layer],
            "best_step": [t["best_step"] for t in per_layer]}


def _trim_heap() -> None:
    """Give the heap's free pages back between layers, so each layer starts from what it holds
    (glibc keeps freed blocks under its mmap threshold, up to 32 MiB each, in its heaps)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_gib() -> float:
    """This process's resident high-water mark since it started (VmHWM). Not getrusage's ru_maxrss:
    that survives execve, so a conversion started by a process that once held more reports the
    parent's peak as its own."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib / 2**20
