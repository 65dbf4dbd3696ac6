"""make bench-end-to-end-tune: a3b-quantize's end-to-end tuning (quant/stream_tune.py) by epochs, on
SmolLM2 at make model's calibration budget.

Each row is one a3b-quantize run in a process of its own (timed, from scratch) on the first TOKENS
tokens of the built-in varied text: untuned, and tuned for one (the default) and three epochs
(make model's). Per row: perplexity on EVAL_TOKENS
tokens of each held-out register (quality.REGISTERS) in float32 in transformers, as make
bench-calibration-budget measures, and what the checkpoint's config records of its tuning (the
held-out KL before and after, the step kept, the tuning's seconds).
"""
from __future__ import annotations

import argparse
import json
import sys

from calibration_budget import EVAL_TOKENS, SOURCE, convert, perplexities, plot, register_ids

from a3b_backend.bench.perf_report import machine
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant.quality import REGISTERS

OUT = PROJECT_ROOT / "perf" / "results" / "end_to_end_tune"
TOKENS = 8192  # make model's budget
# label -> (checkpoint directory's name, a3b-quantize options)
VARIANTS = {
    "untuned": ("layers", ["--tune-epochs", "0"]),
    "tuned end to end, 1 epoch (the default)": ("layers-1-epoch", []),
    "tuned end to end, 3 epochs (make model's)": ("layers-3-epochs", ["--tune-epochs", "3"]),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    ids = register_ids()
    rows = {"bf16 source": {"perplexity": perplexities(SOURCE, ids), "conversion_s": None, "tuning": None}}
    for label, (name, options) in VARIANTS.items():
        seconds, dst = convert(TOKENS, *options, name=f"end-to-end-{name}")
        quantization = json.loads((dst / "config.json").read_text())["quantization_config"]
        rows[label] = {"perplexity": perplexities(dst, ids), "conversion_s": seconds,
                       "tuning": quantization.get("end_to_end_tuning")}
        print(f"{label}: {rows[label]}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "end_to_end_tune.json").write_text(json.dumps({"machine": machine(), "tokens": TOKENS, "rows": rows},
                                                         indent=1))
    base = rows["bf16 source"]["perplexity"]
    lines = ["# End-to-end tuning, layer by layer, by epochs (SmolLM2-135M-Instruct)", "",
             f"Machine: {machine()}. Command: `make bench-end-to-end-tune` (perf/end_to_end_tune.py). Each row is "
             f"a3b-quantize with those options on {TOKENS} tokens of the built-in varied text, from scratch, alone; "
             f"perplexity on {EVAL_TOKENS} tokens of each held-out register in windows of 512, float32 in "
             "transformers (the A3B weights dequantized). Held-out KL: the tuning's own score "
             "on every 8th calibration window, before tuning and as kept.", "",
             "| conversion | " + "".join(f"perplexity, {register} | vs bf16 | " for register in REGISTERS)
             + "held-out KL before / after | step kept / steps | tuning s | conversion s |",
             "|---" * (5 + 2 * len(REGISTERS)) + "|"]
    for label, row in rows.items():
        tuning = row["tuning"]
        tuned = (f"{tuning['held_out_kl'][0]:.4f} / {tuning['held_out_kl'][1]:.4f} | "
                 f"{tuning['best_step']} / {tuning['steps']} | {tuning['seconds']:.0f} | ") if tuning else "| | | "
        seconds = "" if row["conversion_s"] is None else f"{row['conversion_s']:.0f}"
        perplexity = row["perplexity"]
        lines.append(f"| {label} | " + "".join(f"{perplexity[r]:.2f} | {perplexity[r] / base[r] - 1:+.1%} | "
                                                for r in REGISTERS) + tuned + f"{seconds} |")
    (OUT / "end_to_end_tune.md").write_text("\n".join(lines + ["", "![plot](end_to_end_tune.png)"]) + "\n")
    plot(rows, OUT / "end_to_end_tune.png")
    print((OUT / "end_to_end_tune.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
