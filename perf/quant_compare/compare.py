"""A3B against llm-compressor's GPTQ and AWQ W4A16 checkpoints served by stock
vLLM, side by side on the default model (`make compare-quant`).

    .venv/bin/python perf/quant_compare/compare.py [--rounds 5] [--report-only]

Variants (checkpoints under models/quant_compare/, built once, with progress):
  bf16            the default model's checkpoint
  A3B             a3b-quantize's defaults (1x128 blocks, one decoder layer at a time,
                  error-compensating rounding, tuned end to end one epoch:
                  quant/stream_tune.py) calibrated on the shared budget
  A3B, no tuning  the same with --tune-epochs 0 (no end-to-end metadata tuning)
  A3B, tuned block-wise  untuned end to end, with --tune-steps TUNE_STEPS (each layer's
                  rounding and metadata tuned against its float output, AutoRound's recipe)
  A3B, nearest rounding  the defaults, each weight on its fitted table's nearest entry
  A3B uncalibrated  --uncalibrated
  GPTQ W4A16 g64  llm-compressor GPTQModifier, symmetric (perf/quant_compare/peers.py)
  AWQ W4A16 g64   llm-compressor AWQModifier + QuantizationModifier, asymmetric
each peer twice, once per kernel stock vLLM has for it on a CPU:
  W4A16 kernel    cpu_gemm_wna16, bf16 activations (VLLM_CPU_INT4_W4A8=0)
  W4A8 kernel     int4_scaled_mm_cpu, activations rounded to int8 per row;
                  vLLM's default where the CPU has AMX (VLLM_CPU_INT4_W4A8=1),
                  elsewhere the W4A16 kernel runs; the report names the kernel
                  each row ran, as read from the loaded layers
Calibration, one budget for every calibrated variant: SEQUENCES x SEQ_LEN
tokens of `calibrate.broad_calibration_text()` (the licence texts in
/usr/share/common-licenses, and the installed Python packages' READMEs and
docstring prose). A
checkpoint is rebuilt when its build command, the calibration text or (ours) the
converter's code (a3b_backend/quant/*.py) changed.
Evaluation: EVAL_TOKENS tokens of each held-out register (quality.REGISTERS): code-like,
CPython's language reference (`pydoc_data.topics`), as the quality report; and prose, the
standard library's docstrings, which no calibration text reads.

All variants run in one process, each in its own vLLM engine with the cpu
profile's settings except two: bfloat16 instead of the profile's float32
(vLLM's CPU W4A16 kernel, cpu_gemm_wna16, has no float32 path) and prefix
caching off. Our plugin serves A3B, vLLM's own kernels the peers; each
checkpoint's config names its method. Per variant: bits/weight from the stored bytes of
the quantized linear layers (codes and all their metadata) over their weight
count; linear-layer bytes resident in the engine's worker; perplexity from
vLLM's prompt_logprobs over windows of SEQ_LEN; greedy agreement with bf16 on
50 prompts (first 32 tokens); decode tokens/s (64 greedy tokens) and TTFT,
measured in `--rounds` rounds that visit every variant in turn (medians).
Table, JSON and PNG in perf/results/quant_compare/.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import typing
from unittest import mock
from dataclasses import dataclass
from pathlib import Path

from a3b_backend.bench import perf_report
from a3b_backend.quant import calibrate
from a3b_backend.profiles import PROJECT_ROOT

BF16_DIR = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
WORK_DIR = PROJECT_ROOT / "models" / "quant_compare"
QUANT_PYTHON = PROJECT_ROOT / ".venv-quant" / "bin" / "python"
OUT = PROJECT_ROOT / "perf" / "results" / "quant_compare"
SEQUENCES, SEQ_LEN, EVAL_TOKENS, GROUP_SIZE = 128, 512, 8192, 64
# Block-wise tuning's steps per layer: make bench-block-tune's 60, not AutoRound's 200, which would
# take over an hour of a 2-core run (make bench-block-tune: ~55 s a SmolLM2 layer for 60 steps)
# for settings that kept the untuned layers there
TUNE_STEPS = 60
AGREEMENT_TOKENS, DECODE_TOKENS = 32, 64
KV_CACHE_BYTES = 512 * 2**20
DTYPE = "bfloat16"
PeerKernel = typing.Literal["W4A16", "W4A8"]


@dataclass(frozen=True)
class Variant:
    name: str
    directory: Path
    build: list[str] | None  # the command that writes `directory`; None: it exists already
    peer_kernel: PeerKernel | None = None  # which of vLLM's CPU kernels a peer checkpoint is asked to run on

    def engine_env(self) -> dict[str, str]:
        """Environment its engine's process starts with."""
        return {} if self.peer_kernel is None else {"VLLM_CPU_INT4_W4A8": "1" if self.peer_kernel == "W4A8" else "0"}


def calibration_text() -> Path:
    """The shared calibration text, in one file every tool reads."""
    path = WORK_DIR / "calibration.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibrate.broad_calibration_text())
    return path


def variants(calibration: Path) -> list[Variant]:
    calibrated = ["--calibration-text", str(calibration), "--calibration-tokens", str(SEQUENCES * SEQ_LEN)]

    def a3b(name: str, slug: str, *options: str) -> Variant:
        out = WORK_DIR / slug
        return Variant(name, out, [sys.executable, "-m", "a3b_backend.quant.convert", str(BF16_DIR), str(out),
                                   *options])

    def llm_compressor(method: str, kernel: PeerKernel) -> Variant:
        out = WORK_DIR / method
        return Variant(f"{method.upper()} W4A16 g{GROUP_SIZE}, {kernel} kernel", out, [
            str(QUANT_PYTHON), str(Path(__file__).with_name("peers.py")), "--model", str(BF16_DIR),
            "--calibration", str(calibration), "--group-size", str(GROUP_SIZE), "--sequences", str(SEQUENCES),
            "--seq-len", str(SEQ_LEN), "--method", method, "--out", str(out)], kernel)

    # the rounding spelled out: a checkpoint's build record is its command, which must not mean
    # another rounding when a3b-quantize's default changes
    untuned = ("--tune-epochs", "0")
    return [Variant("bf16", BF16_DIR, None),
            a3b("A3B", "a3b-gptq", *calibrated, "--rounding", "gptq", "--tune-epochs", "1"),
            a3b("A3B, no tuning", "a3b-gptq-untuned", *calibrated, "--rounding", "gptq", *untuned),
            a3b("A3B, tuned block-wise", "a3b-gptq-block-wise", *calibrated, "--rounding", "gptq", *untuned,
                "--tune-steps", str(TUNE_STEPS)),
            a3b("A3B, nearest rounding", "a3b", *calibrated, "--rounding", "nearest", "--tune-epochs", "1"),
            a3b("A3B uncalibrated", "a3b-uncalibrated", "--uncalibrated"),
            *(llm_compressor(method, kernel) for method in ("gptq", "awq") for kernel in typing.get_args(PeerKernel))]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_record(variant: Variant, calibration: Path) -> dict:
    """What a checkpoint was built from: its command and, if the command reads it, the calibration text's digest."""
    reads_calibration = str(calibration) in variant.build
    converter = None
    if "a3b_backend.quant.convert" in variant.build:  # our converter: its code is part of what it built
        digest = hashlib.sha256()
        for source in sorted((PROJECT_ROOT / "a3b_backend" / "quant").glob("*.py")):
            digest.update(source.read_bytes())
        converter = digest.hexdigest()
    return {"command": variant.build, "calibration_sha256": sha256(calibration) if reads_calibration else None,
            "converter_sha256": converter}


def build(variant: Variant, calibration: Path) -> float | None:
    """Writes the variant's checkpoint unless one built the same way exists; the seconds it took."""
    if variant.build is None:
        return None
    record = build_record(variant, calibration)
    record_path = variant.directory.with_name(variant.directory.name + ".build.json")
    if (variant.directory / "config.json").exists() and record_path.exists() \
            and json.loads(record_path.read_text()) == record:
        return None
    if variant.build[0] == str(QUANT_PYTHON) and not QUANT_PYTHON.exists():
        raise SystemExit("llm-compressor is not installed: run make quant-tools")
    started = time.monotonic()
    shutil.rmtree(variant.directory, ignore_errors=True)
    subprocess.run(variant.build, check=True, cwd=PROJECT_ROOT)
    record_path.write_text(json.dumps(record, indent=1))
    return time.monotonic() - started


def linear_bits(directory: Path) -> tuple[float, int]:
    """Bits per weight of the quantized linear layers as stored, and their weight count: every
    tensor of a layer whose bf16 weight is 2-D inside the decoder layers."""
    from safetensors import safe_open

    def tensors(d: Path):
        for shard in sorted(d.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)

    layers = {name.removesuffix(".weight"): math.prod(s.get_shape()) for name, s in tensors(BF16_DIR)
              if ".layers." in name and name.endswith(".weight") and len(s.get_shape()) == 2}
    stored = 0
    for name, s in tensors(directory):
        if name.rpartition(".")[0] in layers:
            stored += math.prod(s.get_shape()) * _element_bytes(s.get_dtype())
    weights = sum(layers.values())
    return 8 * stored / weights, weights


def _element_bytes(dtype: str) -> int:
    return {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "I8": 1, "I16": 2}[dtype]


def eval_windows(tokenizer) -> dict[str, list[list[int]]]:
    """Per held-out register (quality.REGISTERS), EVAL_TOKENS tokens in windows of SEQ_LEN + 1."""
    from a3b_backend.quant.quality import REGISTERS

    windows = {}
    for register, text in REGISTERS.items():
        ids = tokenizer.encode(text())[:EVAL_TOKENS + 1]
        windows[register] = [ids[i:i + SEQ_LEN + 1] for i in range(0, len(ids) - 1, SEQ_LEN)
                             if len(ids[i:i + SEQ_LEN + 1]) > 1]
    return windows


def perplexity(llm, windows: list[list[int]]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    total = count = 0
    for window, out in zip(windows, outputs):
        for token, logprobs in zip(window[1:], out.prompt_logprobs[1:]):
            total -= logprobs[token].logprob
            count += 1
    return math.exp(total / count)


def engine(variant: Variant):
    from vllm import LLM

    from a3b_backend.profiles import get_profile

    args = get_profile("cpu").engine_args(PROJECT_ROOT)
    args["model"] = str(variant.directory)
    # every TTFT round sends the same prompt: without this it would time a prefix-cache hit
    args["enable_prefix_caching"] = False
    # room for one max_model_len sequence of this model; every variant's engine stays up for the speed rounds
    args["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    # vLLM's CPU W4A16 kernel (cpu_gemm_wna16) has no float32 path, so every variant runs in bfloat16
    args["dtype"] = DTYPE
    with mock.patch.dict(os.environ, variant.engine_env()):  # the engine's process reads it as it starts
        return LLM(**args)


def measure(chosen: list[Variant], rounds: int) -> list[dict]:
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from a3b_backend.bench.agreement import opening_prompts
    from a3b_backend.bench.engine_probes import linear_kernels, linear_weight_bytes

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model pickles linear_weight_bytes and linear_kernels
    tokenizer = AutoTokenizer.from_pretrained(BF16_DIR)
    windows, agreement_prompts = eval_windows(tokenizer), [TokensPrompt(prompt_token_ids=p) for p in
                                                           opening_prompts(tokenizer)]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    chat_prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(chat, add_special_tokens=False))
    rows, llms = [], {}
    for variant in tqdm(chosen, desc="engines: quality", unit="variant"):
        llm = llms[variant.name] = engine(variant)
        bits, weights = linear_bits(variant.directory)
        greedy = llm.generate(agreement_prompts, SamplingParams(temperature=0, max_tokens=AGREEMENT_TOKENS,
                                                                ignore_eos=True), use_tqdm=False)
        rows.append({"variant": variant.name, "peer_kernel": variant.peer_kernel, "bits_per_weight": bits,
                     "linear_weights": weights,
                     "linear_resident_bytes": llm.apply_model(linear_weight_bytes)[0]["resident"],
                     "kernels": llm.apply_model(linear_kernels)[0],
                     "perplexity": {register: perplexity(llm, w) for register, w in windows.items()},
                     "eval_tokens": sum(len(w) - 1 for w in next(iter(windows.values()))),
                     "greedy_tokens": [list(o.outputs[0].token_ids) for o in greedy], "decode": [], "ttft": []})
        tqdm.write(f"{variant.name}: {bits:.3f} bits/weight, perplexity "
                   + ", ".join(f"{p:.2f} ({register})" for register, p in rows[-1]["perplexity"].items()))
    decode = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    for _ in tqdm(range(rounds), desc="speed rounds", unit="round"):
        for row in rows:
            llm = llms[row["variant"]]
            started = time.perf_counter()
            llm.generate([chat_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            row["ttft"].append(time.perf_counter() - started)
            started = time.perf_counter()
            llm.generate([chat_prompt], decode, use_tqdm=False)
            row["decode"].append(DECODE_TOKENS / (time.perf_counter() - started))
    return rows


def _agreement(row: dict, base: dict) -> tuple[int, float]:
    """Prompts whose greedy tokens all equal bf16's, and the mean length of the common prefix."""
    pairs = list(zip(row["greedy_tokens"], base["greedy_tokens"]))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
    return sum(a == b for a, b in pairs), statistics.mean(prefix)


def fastest_peer(rows: list[dict], kernel: PeerKernel) -> float:
    """The best median decode tokens/s among the peers on `kernel`."""
    return max((statistics.median(r["decode"]) for r in rows if r["peer_kernel"] == kernel), default=float("nan"))


def perplexities(row: dict) -> dict[str, float]:
    """A row's perplexity per held-out register (a run before the prose register measured the code-like one)."""
    from a3b_backend.quant.quality import REGISTERS

    found = row["perplexity"]
    return found if isinstance(found, dict) else {next(iter(REGISTERS)): found}


def markdown(rows: list[dict]) -> str:
    base = rows[0]
    registers = list(perplexities(base))
    kernels = [kernel for kernel in typing.get_args(PeerKernel) if any(r["peer_kernel"] == kernel for r in rows)]
    fastest = {kernel: fastest_peer(rows, kernel) for kernel in kernels}
    lines = ["| variant | bits/weight (stored) | resident linear MiB | "
             + "".join(f"perplexity, {register} | vs bf16 | " for register in registers)
             + f"greedy = bf16 (of {len(base['greedy_tokens'])}) | mean common prefix (of {AGREEMENT_TOKENS}) "
             "| decode tok/s (median) "
             + "".join(f"| vs best peer, {kernel} kernel " for kernel in kernels) + "| TTFT ms (median) | kernel |",
             "|---" * (8 + 2 * len(registers) + len(kernels)) + "|"]
    for r in rows:
        speed = statistics.median(r["decode"])
        same, prefix = _agreement(r, base)
        # vLLM's CPU GEMM for unquantized layers repacks the weights outside the layers' parameters
        resident = f"{r['linear_resident_bytes'] / 2**20:.1f}" if r["linear_resident_bytes"] else "repacked by vLLM"
        lines.append(
            f"| {r['variant']} | {r['bits_per_weight']:.3f} | {resident} | "
            + "".join(f"{perplexities(r)[register]:.2f} | "
                      f"{100 * (perplexities(r)[register] / perplexities(base)[register] - 1):+.1f}% | "
                      for register in registers)
            + f"{same} | {prefix:.1f} | {speed:.1f} | "
            + "".join(f"{speed / fastest[kernel]:.2f}x | " for kernel in kernels)
            + f"{1000 * statistics.median(r['ttft']):.0f} | {', '.join(r['kernels'])} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        code_like = next(iter(perplexities(r).values()))
        axes[0].scatter(r["bits_per_weight"], code_like, s=40)
        axes[0].annotate(r["variant"], (r["bits_per_weight"], code_like), fontsize=8)
        if r["linear_resident_bytes"]:  # 0: repacked outside the layers' parameters, not measured
            point = (r["linear_resident_bytes"] / 2**20, statistics.median(r["decode"]))
            axes[1].scatter(*point, s=40)
            axes[1].annotate(r["variant"], point, fontsize=8)
    axes[0].set(xlabel="bits/weight (stored)", ylabel="perplexity through vLLM (code-like register)", xscale="log", yscale="log",
                title="quality vs size")
    axes[1].set(xlabel="resident linear-layer MiB in the engine", ylabel="decode tokens/s (median)",
                title=f"speed vs memory (vllm-cpu, {DTYPE})")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(rows: list[dict], build_seconds: dict, calibration_sha256: str, rounds: int, out: Path,
                 command: str, machine: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_compare.json").write_text(json.dumps(
        {"machine": machine, "command": command, "rounds": rounds, "build_seconds": build_seconds,
         "calibration_sha256": calibration_sha256, "rows": rows}, indent=1))
    plot(rows, out / "quant_compare.png")
    built = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in build_seconds.items()) or "(all cached)"
    peers = any(r["peer_kernel"] for r in rows)
    (out / "quant_compare.md").write_text(
        ("# A3B vs llm-compressor W4A16 on vllm-cpu (SmolLM2-135M-Instruct)\n\n" if peers else
         "# A3B's conversions on vllm-cpu (SmolLM2-135M-Instruct)\n\n") +
        f"Machine: {machine}. Command: `{command}`. "
        f"Calibration (every calibrated variant): the first {SEQUENCES} x {SEQ_LEN} tokens of "
        f"`calibrate.broad_calibration_text()`: the licence texts in {calibrate.LICENCE_TEXTS}, and of each "
        f"Python package installed in .venv its long description (README) and its docstrings' prose paragraphs, "
        f"the first {calibrate.DOCUMENT_CHARS} characters of each, shuffled (sha256 {calibration_sha256[:16]}...; "
        "READMEs hold Python code examples, a register nearer the code-like evaluation text than the licences; "
        "no paragraph of the prose register is read). "
        f"Evaluation: {rows[0]['eval_tokens']} tokens of each held-out register in windows of {SEQ_LEN}, "
        "perplexity from vLLM's prompt_logprobs: code-like, CPython's language reference (`pydoc_data.topics`)"
        + (", and prose, the standard library's docstrings (`quality.prose_text()`, in no calibration text)"
           if len(perplexities(rows[0])) > 1 else "") + ". Speed: "
        f"{DECODE_TOKENS} greedy tokens and a 1-token TTFT on a chat prompt, {rounds} rounds over all variants, "
        f"medians. Every variant in {DTYPE} activations (vLLM's CPU W4A16 kernel has no float32 path), eager, "
        f"prefix caching off. Conversion times (this run): {built}.\n\n"
        + ("Each peer checkpoint runs on both of stock vLLM's CPU kernels for it: the W4A16 kernel "
        "(`cpu_gemm_wna16`, bf16 activations, `VLLM_CPU_INT4_W4A8=0`) and the W4A8 kernel "
        "(`int4_scaled_mm_cpu`: activations rounded to int8 per row, int8 AMX tiles), which vLLM picks by "
        "default for these checkpoints on a CPU with AMX. The last column names the kernel each row's layers "
        "ran, read from the loaded model.\n\n" if peers else "")
        + "The default model's bf16 weights were rebuilt from a Q4_1 GGUF (4-bit, 32-weight blocks with an fp16 "
        "scale and minimum each), so every 4-bit format is measured against weights that were once 4-bit: a "
        "grid that can land on the old one (asymmetric groups dividing 32) is favoured.\n\n"
        f"{markdown(rows)}\n![plots](quant_compare.png)\n")


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="+", metavar="VARIANT", help="measure only these variants (bf16 first)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--report-only", action="store_true", help="redraw from the saved JSON")
    args = parser.parse_args(argv)
    if args.report_only:
        saved = json.loads((args.out / "quant_compare.json").read_text())
        write_report(saved["rows"], saved["build_seconds"], saved["calibration_sha256"], saved["rounds"], args.out,
                     saved.get("command", "make compare-quant"), saved["machine"])
        return 0
    calibration = calibration_text()
    chosen = [v for v in variants(calibration) if not args.only or v.name in args.only]
    build_seconds = {}
    for variant in tqdm(chosen, desc="checkpoints", unit="variant"):
        seconds = build(variant, calibration)
        if seconds is not None:
            build_seconds[variant.name] = seconds
    rows = measure(chosen, args.rounds)
    command = shlex.join(["python", "perf/quant_compare/compare.py", *(sys.argv[1:] if argv is None else argv)])
    write_report(rows, build_seconds, sha256(calibration), args.rounds, args.out, command, perf_report.machine())
    print(markdown(rows))
    print(f"wrote {args.out / 'quant_compare.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
