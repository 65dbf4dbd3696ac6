"""make bench-block-tune: what block-wise tuning (a3b_backend/quant/block_tune.py) does to a layer's
held-out loss, per setting, against the error-compensating rounding it starts from.

SmolLM2's first LAYERS decoder layers, calibrated by the layer pipeline on TOKENS tokens of the
built-in varied text (float chain, every HELD_OUT_EVERY-th window held out), each rounded
error-compensating and then tuned for STEPS steps under each setting below; the held-out loss
(each output channel's squared error over its mean square in the float output) every
EVALUATE_EVERY steps, as a multiple of the error-compensating rounding's. The last setting starts
from nearest rounding, as AutoRound does. Writes perf/results/block_tune/ (md, JSON, PNG).
"""
from __future__ import annotations

import argparse
import json
import time

from tqdm import tqdm

from a3b_backend.bench.perf_report import machine
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant import sequential
from a3b_backend.quant.block_tune import HELD_OUT_EVERY, BlockTuneConfig
from a3b_backend.quant.convert import calibration_file
from a3b_backend.quant.format import A3BConfig

SOURCE = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
OUT = PROJECT_ROOT / "perf" / "results" / "block_tune"
LAYERS, TOKENS, STEPS, EVALUATE_EVERY = 2, 16384, 60, 10
# label -> (rounding it starts from, the setting)
SETTINGS = {
    "sign-SGD: rounding, block codes, row scales": ("gptq", {}),
    "sign-SGD: rounding": ("gptq", {"code_travel": 0, "scale_travel": 0}),
    "sign-SGD: row scales": ("gptq", {"rounding_travel": 0, "code_travel": 0}),
    "Adam: rounding, travel 0.05": ("gptq", {"optimizer": "adam", "rounding_travel": 0.05, "code_travel": 0,
                                             "scale_travel": 0}),
    "Adam: block codes, row scales": ("gptq", {"optimizer": "adam", "rounding_travel": 0, "code_travel": 0.6,
                                               "scale_travel": 0.03}),
    "sign-SGD: rounding, from nearest rounding": ("nearest", {"code_travel": 0, "scale_travel": 0}),
}


def run(label: str, rounding: str, setting: dict, bar) -> list[dict]:
    tune_config = BlockTuneConfig(steps=STEPS, evaluate_every=EVALUATE_EVERY, **setting)
    with calibration_file(None) as text:
        windows = sequential.windows_of(SOURCE, text, TOKENS)
    source = sequential.Source.open(SOURCE)
    hidden, calls, layers = sequential.layer_inputs(sequential.skeleton(SOURCE), source, windows)
    rows = []
    for index in range(LAYERS):
        started = time.perf_counter()
        layer, expert_names = sequential.load_layer(layers[index], source, index)
        result = sequential.quantize_layer(layer, index, source, hidden, calls[index], A3BConfig(), rounding, False,
                                           expert_names, tune_config)
        hidden = result.float_outputs
        rows.append({"setting": label, "starts_from": rounding, "layer": index, **result.tuning.to_json(),
                     "history": result.tuning.history, "seconds": time.perf_counter() - started})
        bar.update()
    return rows


def plot(rows: list[dict], reference: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, LAYERS, figsize=(6 * LAYERS, 4), squeeze=False)
    for row in rows:
        steps, losses = zip(*row["history"])
        axes[0][row["layer"]].plot(steps, [loss / reference[row["layer"]] for loss in losses], label=row["setting"])
    for layer, ax in enumerate(axes[0]):
        ax.axhline(1, color="black", lw=0.8)
        ax.set(title=f"layer {layer}", xlabel="step", ylabel="held-out loss / error-compensating rounding's",
               yscale="log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    rows = []
    with tqdm(total=len(SETTINGS) * LAYERS, desc="tuning settings x layers", unit="layer") as bar:
        for label, (rounding, setting) in SETTINGS.items():
            rows += run(label, rounding, setting, bar)
    # every setting sees the same float-chain inputs: the error-compensating rounding's loss is the reference
    reference = {r["layer"]: r["held_out_before"] for r in rows if r["starts_from"] == "gptq"}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "block_tune.json").write_text(json.dumps({"machine": machine(), "layers": LAYERS, "tokens": TOKENS,
                                                     "steps": STEPS, "rows": rows}, indent=1))
    lines = ["# Block-wise tuning against the error-compensating rounding (SmolLM2-135M-Instruct)", "",
             f"Machine: {machine()}. Command: `make bench-block-tune`. Layers 0-{LAYERS - 1}, the layer pipeline on "
             f"{TOKENS} tokens of the built-in varied text (float chain; every {HELD_OUT_EVERY}th window of 512 held "
             f"out), {STEPS} steps of 4 windows per setting, the held-out loss every {EVALUATE_EVERY} steps as a "
             "multiple of the error-compensating rounding's (below 1: better). The best is the lowest of those, "
             "iteration 0 included (what the conversion keeps).", "",
             "| setting | starts from | layer | at its start | at the last step | lowest of the tuned steps | kept |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = reference[r["layer"]]
        tuned = [loss for step, loss in r["history"] if step > 0]
        kept = "untuned" if r["best_step"] == 0 else f"step {r['best_step']}"
        lines.append(f"| {r['setting']} | {r['starts_from']} rounding | {r['layer']} | "
                     f"{r['held_out_before'] / ref:.3f} | {tuned[-1] / ref:.3f} | {min(tuned) / ref:.3f} | {kept} |")
    (OUT / "block_tune.md").write_text("\n".join(lines + ["", "![held-out loss by step](block_tune.png)"]) + "\n")
    plot(rows, reference, OUT / "block_tune.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
