"""Quality report: perplexity and weight error of A3B variants against bf16 and RTN baselines.

    a3b-quality [--model models/smollm2-135m-instruct] [--out perf/quality]

Evaluation text: the Python language reference shipped with CPython
(`pydoc_data.topics`); calibration text: the GNU GPL v3 text shipped by Debian
(`/usr/share/common-licenses/GPL-3`). Different texts, both real English.
Bits per weight are measured: bytes of the stored quantized tensors (codes and
all metadata) over the number of weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from a3b_backend.profiles import LICENCE_TEXTS, PROJECT_ROOT
from a3b_backend.quant import calibrate
from a3b_backend.quant.baselines import RtnConfig, quantize_dequantize
from a3b_backend.quant.convert import LinearCalibration, fold_norm_scale
from a3b_backend.quant.format import A3BConfig, dequantize, quantize

CALIBRATION_TEXT = LICENCE_TEXTS / "GPL-3"
SEQ_LEN = 512


# Each quantized alone in a row of its own: where the perplexity loss comes from
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (projection regex, block shape) pairs: the first whose regex a linear's name matches sets its block
FinerBlocks = tuple[tuple[str, tuple[int, int]], ...]
# Finer blocks for some projections, the rest at 1x128, one variant each. vLLM serves q/k/v as one
# layer, so v_proj alone finer needs per-shard blocks there.
MIXED_BLOCKS: tuple[FinerBlocks, ...] = (
    ((r"down_proj$", (1, 32)),),
    ((r"down_proj$", (1, 32)), (r"o_proj$", (1, 64))),
    ((r"down_proj$", (1, 32)), (r"(q|k|v)_proj$", (1, 64))),
    ((r"down_proj$", (1, 32)), (r"v_proj$", (1, 32))),
)

MIXED = "A3B mixed blocks"
ONE_PROJECTION = "A3B one projection"


@dataclasses.dataclass
class Variant:
    name: str
    family: str  # "bf16" | "A3B" | "INT4" | "INT3" ...
    aware: bool
    # (linear name, weight, importance or None) -> (dequantized weight, bytes on disk)
    run: Callable[[str, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, int]] | None
    layers: str | None = None  # regex: only these linears are quantized, the others keep the source weights


def _a3b(config: A3BConfig, finer: FinerBlocks = ()):
    def run(name, w, importance):
        block = next((b for pattern, b in finer if re.search(pattern, name)), config.block)
        layer_config = dataclasses.replace(config, block_rows=block[0], block_cols=block[1])
        q = quantize(w, layer_config, col_importance=importance)
        return dequantize(q, layer_config), q.nbytes()
    return run


def _rtn(config: RtnConfig):
    return lambda _name, w, _importance: quantize_dequantize(w, config)


def _mixed_label(finer: FinerBlocks) -> str:
    return ", ".join(f"{pattern.removesuffix('$')} {r}x{c}" for pattern, (r, c) in finer)


def variants() -> list[Variant]:
    out = [Variant("bf16", "bf16", False, None)]
    for bits, group in ((4, 128), (3, 128), (4, 32)):
        out.append(Variant(f"INT{bits} RTN g{group}", f"INT{bits} g{group}", False, _rtn(RtnConfig(bits, group))))
    out.append(Variant("INT4 RTN g128 + AWQ", "INT4 g128", True, _rtn(RtnConfig(4, 128))))
    for rows, cols in ((64, 64), (1, 64), (1, 128)):
        for aware in (False, True):
            label = f"A3B {rows}x{cols}" + (" + calib" if aware else "")
            out.append(Variant(label, f"A3B {rows}x{cols}", aware, _a3b(A3BConfig(rows, cols))))
    for finer in MIXED_BLOCKS:
        out.append(Variant(f"A3B 1x128, {_mixed_label(finer)} + calib", MIXED, True,
                           _a3b(A3BConfig(1, 128), finer)))
    for projection in PROJECTIONS:
        out.append(Variant(f"A3B 1x128 + calib, {projection} only", ONE_PROJECTION, True,
                           _a3b(A3BConfig(1, 128)), layers=rf"\.{projection}$"))
    return out


def eval_text() -> str:
    """The code-like held-out register: CPython's language reference (grammar, examples, prose)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def prose_text() -> str:
    """The prose held-out register: English technical prose every Python ships and no calibration
    text reads, the paragraphs of the standard library's docstrings (`calibrate.stdlib_prose`) in
    one fixed shuffled order."""
    paragraphs = list(calibrate.stdlib_prose())
    random.Random(0).shuffle(paragraphs)
    return "\n\n".join(paragraphs)


# The held-out registers every quality report gives: name -> text
REGISTERS = {"code-like (CPython's language reference)": eval_text,
             "prose (the standard library's docstrings)": prose_text}


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, SEQ_LEN):
        window = ids[start:start + SEQ_LEN + 1]
        if window.numel() < 2:
            break
        logits = model(window[:-1].unsqueeze(0)).logits[0]
        total += torch.nn.functional.cross_entropy(logits.float(), window[1:], reduction="sum").item()
        count += window.numel() - 1
    return math.exp(total / count)


@torch.no_grad()
def apply_variant(model, originals, stats, variant: Variant, stored_dtype: torch.dtype) -> dict:
    """Quantizes the model's linears in place (those `variant.layers` selects). AWQ
    scales are applied as the converter stores them: the linears keep the scaled
    weights, each RMSNorm is divided by its scale in the checkpoint's dtype and each
    up_proj's rows by its down_proj's scale; a linear left unquantized beside a
    selected one reads the same norm (or feeds the same down_proj), so it keeps its
    source weight scaled."""
    linears = calibrate.quantized_linears(model)
    selected = {n for n in linears if variant.layers is None or re.search(variant.layers, n)}
    scales: dict[str, torch.Tensor] = {}
    row_divisors: dict[str, torch.Tensor] = {}
    if variant.aware:
        norm_groups = calibrate.groups(list(linears))
        quant_dequant = lambda name, w, importance: variant.run(name, w, importance)[0]  # noqa: E731
        for norm, members in tqdm(calibrate.groups(sorted(selected)).items(), desc="searching AWQ scales",
                                  unit="group", leave=False):
            s = calibrate.choose_scale({m: originals[m] for m in members}, stats[members[0]], quant_dequant)
            scales.update({m: s for m in norm_groups[norm]})
            weight = model.get_parameter(f"{norm}.weight")
            weight.copy_(fold_norm_scale(weight.to(stored_dtype), s, zero_centred=False).float())
        for down, up in calibrate.row_folds(sorted(linears)).items():
            if down in selected:
                s = calibrate.choose_scale({down: originals[down]}, stats[down], quant_dequant)
                scales[down], row_divisors[up] = s, s
    nbytes, weights, rel_errors = 0, 0, []
    for name, module in tqdm(linears.items(), desc=variant.name, unit="linear", leave=False):
        w = originals[name]
        calibration = LinearCalibration(stats[name].importance, scales.get(name), row_divisor=row_divisors.get(name))
        stored, reads = calibration.scaled(w)
        if name not in selected:
            module.weight.copy_(stored)
            continue
        deq, size = variant.run(name, stored, reads.importance if variant.aware else None)
        module.weight.copy_(deq.to(module.weight.dtype))
        nbytes += size
        weights += w.numel()
        # the weight error is taken against the source, in its own scale
        rel_errors.append((calibration.source(deq) - w).norm().item() / w.norm().item())
    return {"bits_per_weight": 8 * nbytes / weights, "quantized_bytes": nbytes,
            "weight_error": sum(rel_errors) / len(rel_errors)}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "quality")
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--only", nargs="*", help="variant names to run, replacing their saved rows (default: all)")
    parser.add_argument("--report-only", action="store_true", help="redraw the report from OUT/results.json")
    args = parser.parse_args(argv)
    if args.report_only:
        rows = json.loads((args.out / "results.json").read_text())
        meta = json.loads((args.out / "run.json").read_text())
        write_report(rows, args, **meta)
        return 0

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().requires_grad_(False)
    eval_ids = torch.tensor(tokenizer.encode(eval_text())[: args.eval_tokens])
    calib_ids = torch.tensor(tokenizer.encode(calibrate.load_text(CALIBRATION_TEXT))[: args.calibration_tokens])
    stats = calibrate.collect(model, calib_ids, SEQ_LEN)
    linears = calibrate.quantized_linears(model)
    originals = {n: m.weight.detach().clone() for n, m in linears.items()}
    norm_originals = {f"{norm}.weight": model.get_parameter(f"{norm}.weight").detach().clone()
                      for norm in calibrate.groups(list(linears))}
    stored_dtype = AutoConfig.from_pretrained(args.model).dtype
    other_bytes = sum(p.numel() * 2 for n, p in model.named_parameters()
                      if n.removesuffix(".weight") not in linears)
    rows = []
    chosen = [v for v in variants() if not args.only or v.name in args.only]
    for variant in tqdm(chosen, desc="variants", unit="variant"):
        start = time.time()
        if variant.run is None:
            result = {"bits_per_weight": 16.0, "quantized_bytes": sum(w.numel() * 2 for w in originals.values()),
                      "weight_error": 0.0}
        else:
            result = apply_variant(model, originals, stats, variant, stored_dtype)
        result.update(name=variant.name, family=variant.family, aware=variant.aware,
                      perplexity=perplexity(model, eval_ids), file_bytes=other_bytes + result["quantized_bytes"],
                      seconds=round(time.time() - start, 1))
        rows.append(result)
        tqdm.write(json.dumps(result))
        for name, module in linears.items():
            module.weight.copy_(originals[name])
        for name, weight in norm_originals.items():
            model.get_parameter(name).detach().copy_(weight)
    meta = dict(tokenizer_name=args.model.name, eval_tokens=eval_ids.numel(), calib_tokens=calib_ids.numel())
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    if args.only and saved.exists():  # the other variants' rows stay as last measured
        fresh = {r["name"]: r for r in rows}
        rows = [fresh.pop(r["name"], r) for r in json.loads(saved.read_text())] + list(fresh.values())
    (args.out / "run.json").write_text(json.dumps(meta))
    write_report(rows, args, **meta)
    return 0


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    """Curves to draw: A3B groups (plain / calibrated), A3B tiles, RTN, RTN + AWQ."""
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r["family"] in ("bf16", ONE_PROJECTION):
            continue
        if r["family"].startswith("A3B"):
            kind = {"A3B 64x64": "A3B 64x64 tiles", MIXED: MIXED}.get(r["family"], "A3B 1xC groups")
            label = kind + (" + calib" if r["aware"] else "")
        else:
            label = "RTN + AWQ" if r["aware"] else "RTN (INT3/INT4)"
        series.setdefault(label, []).append(r)
    return series


def write_report(rows: list[dict], args, tokenizer_name: str, eval_tokens: int, calib_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    base = next((r["perplexity"] for r in rows if r["family"] == "bf16"), float("nan"))
    lines = [
        f"# A3B quality report: {tokenizer_name}", "",
        f"Command: `make quality` (`a3b-quality`). Evaluation: {eval_tokens} tokens of the Python language "
        f"reference (CPython `pydoc_data.topics`), windows of {SEQ_LEN}. Calibration: {calib_tokens} tokens of "
        "the GNU GPL v3 text (`/usr/share/common-licenses/GPL-3`).", "",
        "The default model's weights were rebuilt from a Q4_1 GGUF (4-bit, 32-weight blocks with an fp16 scale "
        "and minimum each), so every format here is measured against weights that were once 4-bit; that biases "
        "the comparison towards formats whose grid can land on the old one. INT4 RTN g32 has the GGUF's block "
        "size but an integer zero-point, so it does not reproduce the old grid exactly (see its row).", "",
        "`+ calib`: activation-aware (importance-weighted fit for every layer; AWQ scales for q/k/v and gate/up, "
        "alpha searched per layer group for the lowest output error, folded into their RMSNorm, and for down_proj, "
        "folded into up_proj's rows). `+ AWQ`: AWQ scales searched the same way for RTN, then plain RTN. Both as "
        "the converter stores them: the linears keep the scaled weights and each RMSNorm is divided by its scale "
        "in the checkpoint's dtype.", "",
        "| variant | bits/weight (measured) | perplexity | delta vs bf16 | mean rel. weight error | file size (MB) |",
        "|---|---|---|---|---|---|",
    ]
    table = [r for r in rows if r["family"] != ONE_PROJECTION]
    for r in table:
        lines.append(f"| {r['name']} | {r['bits_per_weight']:.3f} | {r['perplexity']:.2f} | "
                     f"{r['perplexity'] - base:+.2f} | {r['weight_error']:.4f} | {r['file_bytes'] / 1e6:.1f} |")
    alone = [r for r in rows if r["family"] == ONE_PROJECTION]
    if alone:
        lines += [
            "", "## Where the loss comes from", "",
            "Each projection quantized alone (A3B 1x128 + calib, every other linear at its source weights): "
            "the perplexity it costs, and its share of the sum over projections. `A3B 1x128, ...` rows above "
            "give the projections that cost most finer blocks (vLLM serves q/k/v as one layer and gate/up as "
            "another: a block shape for v_proj alone needs a per-shard block shape in that layer).", "",
            "| projection quantized alone | perplexity | delta vs bf16 | share of the summed delta |",
            "|---|---|---|---|",
        ]
        total = sum(r["perplexity"] - base for r in alone)
        for r in alone:
            lines.append(f"| {r['name'].rsplit(', ', 1)[1]} | {r['perplexity']:.2f} | {r['perplexity'] - base:+.2f} "
                         f"| {(r['perplexity'] - base) / total:.0%} |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(8, 5))
    top = max(4 * base, 60.0)
    for label, members in _series(rows).items():
        pts = sorted(members, key=lambda r: r["bits_per_weight"])
        xs = [p["bits_per_weight"] for p in pts]
        ys = [min(p["perplexity"], top) for p in pts]
        ax.plot(xs, ys, marker="^" if "calib" in label or "AWQ" in label else "o", label=label)
        for p, y in zip(pts, ys):
            if p["family"] == MIXED:  # side by side at 4.39-4.42 bits: the table names them
                continue
            note = p["name"].replace(" + calib", "").replace(" + AWQ", "")
            if p["perplexity"] > top:
                note += f" (ppl {p['perplexity']:.0f}, off scale)"
            ax.annotate(note, (p["bits_per_weight"], y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhline(base, color="gray", linestyle="--", label=f"bf16 ({base:.2f})")
    ax.set_xlabel("bits per weight (measured, incl. metadata)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_ylim(base * 0.95, top * 1.05)
    ax.legend(fontsize=7)
    ax.set_title(f"{tokenizer_name}: perplexity vs bits per weight")
    fig.tight_layout()
    fig.savefig(args.out / "ppl_vs_bpw.png", dpi=120)
    print(f"wrote {args.out / 'report.md'} and {args.out / 'ppl_vs_bpw.png'}")


if __name__ == "__main__":
    sys.exit(main())
