"""A3B KV cache quality report (`make kv-report`, perf/results/a3b_kv.md):
bytes per token and layer, attention error against fp16 K/V, and SmolLM2's
perplexity with K/V quantized, for fp8 and A3B (plain and Hadamard-rotated),
all through the torch reference path of `a3b_kernels.kv_cache`.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

from a3b_backend.bench.perf_report import machine
from a3b_kernels.kv_cache import QWEN36, SMOLLM2, AttentionShape, a3b_roundtrip, bytes_per_token_layer
from a3b_backend.profiles import PROJECT_ROOT



def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention, q[heads, T, d], k/v[kv_heads, T, d]."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]


def gaussian_qkv(shape: AttentionShape, tokens: int, g: torch.Generator):
    """q[heads, T, d], k/v[kv_heads, T, d]: Gaussian, with a few large key
    channels (as real keys have)."""
    q = torch.randn(shape.kv_heads * 4, tokens, shape.head_dim, generator=g)
    k = torch.randn(shape.kv_heads, tokens, shape.head_dim, generator=g)
    k[..., :4] *= 8
    return q, k, torch.randn(shape.kv_heads, tokens, shape.head_dim, generator=g)


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x through an fp8 (e4m3) cache with scale 1, vLLM's default fp8 KV."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


# K/V cache variants compared in the report: name -> write-then-read of x[..., head_dim]
ROUNDTRIPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp8 (e4m3)": fp8_roundtrip,
    "A3B, plain": lambda x: a3b_roundtrip(x, rotated=False),
    "A3B, Hadamard-rotated (the format)": a3b_roundtrip,
}


def attention_error(shape: AttentionShape, tokens: int, roundtrip: Callable[[torch.Tensor], torch.Tensor],
                    seed: int = 0) -> float:
    """Relative L2 error of the attention output, K/V through `roundtrip` vs fp16 K/V."""
    q, k, v = gaussian_qkv(shape, tokens, torch.Generator().manual_seed(seed))
    ref = attention(q, k.half().float(), v.half().float())
    got = attention(q, roundtrip(k), roundtrip(v))
    return ((got - ref).norm() / ref.norm()).item()


def kv_quantized_perplexity(model_dir: Path, eval_tokens: int) -> dict[str, float]:
    """SmolLM2 perplexity with fp16 K/V and with K/V through each of ROUNDTRIPS. K/V are quantized where attention reads them, after
    RoPE, as a cache holds them (a transformers attention function wrapping SDPA)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from a3b_backend.quant.quality import eval_text, perplexity

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer.encode(eval_text())[:eval_tokens])
    cache: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

    def a3b_kv_attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, cache["kv"](key), cache["kv"](value), attention_mask, **kwargs)

    AttentionInterface.register("a3b_kv_reference", a3b_kv_attention)
    model.set_attn_implementation("a3b_kv_reference")
    variants = {"fp16": lambda x: x.half().float(), **ROUNDTRIPS}
    results = {}
    for name, roundtrip in variants.items():
        cache["kv"] = roundtrip
        results[name] = perplexity(model, ids)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "perf" / "results" / "a3b_kv.md")
    args = parser.parse_args(argv)
    lines = ["# A3B KV cache (reference path)\n", f"Machine: {machine()}. Command: `make kv-report`.\n",
             "| model | KV dtype | bytes/token/layer | vs fp16 | KV cache at 128K context, all attention layers |",
             "|---|---|---|---|---|"]
    for shape in (QWEN36, SMOLLM2):
        fp16 = bytes_per_token_layer(shape, "fp16")
        for dtype in ("fp16", "fp8", "a3b"):
            b = bytes_per_token_layer(shape, dtype)
            total = b * 131072 * shape.attention_layers / 2**30
            lines.append(f"| {shape.name} | {dtype} | {b:.0f} | {b / fp16:.3f} | {total:.2f} GiB |")
    lines += ["", "Attention output vs fp16 K/V, relative L2 error (Qwen3.6 head shape, Gaussian q/k/v, "
              "4 key channels x8):", "", "| tokens | " + " | ".join(ROUNDTRIPS) + " |",
              "|---" * (len(ROUNDTRIPS) + 1) + "|"]
    for t in (512, 2048):
        lines.append(f"| {t} | " + " | ".join(f"{attention_error(QWEN36, t, rt):.4f}" for rt in ROUNDTRIPS.values())
                     + " |")
    print("\n".join(lines), flush=True)
    ppl = kv_quantized_perplexity(args.model, args.eval_tokens)
    lines += ["", f"SmolLM2-135M-Instruct perplexity on {args.eval_tokens} tokens of CPython's language reference "
              "(weights unquantized; K/V quantized after RoPE, as cached):", "",
              "| K/V | perplexity | vs fp16 |", "|---|---|---|"]
    lines += [f"| {name} | {value:.3f} | {(value / ppl['fp16'] - 1) * 100:+.2f}% |" for name, value in ppl.items()]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-5:]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
