"""A3B KV cache, torch reference: each token's K or V vector per KV head is a
row of the A3B format (docs/a3b_format.md) in 1 x block blocks, quantized as
it is written and dequantized where attention reads it. Also the cache's bytes
per token, and the report:

    make kv-report       # perf/results/a3b_kv.md: bytes/token/layer, attention error, SmolLM2 perplexity

Bytes per token per layer, A3B: head_dim/2 code bytes + 3 bytes (lo, step,
delta) per block + 4 bytes of bf16 row scales, per KV head, for K and for V.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from a3b_backend.quant.format import A3BConfig, dequantize, quantize

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    name: str
    kv_heads: int
    head_dim: int
    # layers that keep a KV cache (Gated DeltaNet layers keep a fixed-size state instead)
    attention_layers: int


# SmolLM2-135M from its config.json; Qwen3.6-35B-A3B: Qwen3.5-family hybrid
# layout (head_dim 256, every 4th of 40 layers full attention), 2 KV heads
# assumed until the checkpoint's config.json is read on the GPU host.
SMOLLM2 = AttentionShape("SmolLM2-135M", kv_heads=3, head_dim=64, attention_layers=30)
QWEN36 = AttentionShape("Qwen3.6-35B-A3B (assumed 2 KV heads)", kv_heads=2, head_dim=256, attention_layers=10)


def bytes_per_token_layer(shape: AttentionShape, dtype: str, block: int = 128) -> float:
    """K and V bytes one token adds to one attention layer's cache."""
    per_head = {"fp16": 2 * shape.head_dim, "fp8": shape.head_dim}.get(dtype)
    if dtype == "a3b":
        blocks = -(-shape.head_dim // block)
        per_head = shape.head_dim / 2 + 3 * blocks + 4
    if per_head is None:
        raise ValueError(f"unknown KV dtype {dtype!r}: fp16, fp8 or a3b")
    return 2 * shape.kv_heads * per_head


def a3b_roundtrip(x: torch.Tensor, block: int) -> torch.Tensor:
    """x[..., head_dim] written to and read back from an A3B cache."""
    rows = x.reshape(-1, x.shape[-1]).float()
    config = A3BConfig(1, min(block, x.shape[-1]), iterations=2)
    return dequantize(quantize(rows, config, name="kv"), config).reshape(x.shape).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention, q[heads, T, d], k/v[kv_heads, T, d]."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]


def attention_error(shape: AttentionShape, tokens: int, seed: int = 0) -> float:
    """Relative L2 error of the attention output, A3B K/V vs fp16 K/V, on
    Gaussian q/k/v with a few large key channels (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    heads = shape.kv_heads * 4
    q = torch.randn(heads, tokens, shape.head_dim, generator=g)
    k = torch.randn(shape.kv_heads, tokens, shape.head_dim, generator=g)
    k[..., :4] *= 8
    v = torch.randn(shape.kv_heads, tokens, shape.head_dim, generator=g)
    ref = attention(q, k.half().float(), v.half().float())
    got = attention(q, a3b_roundtrip(k, 128), a3b_roundtrip(v, 128))
    return ((got - ref).norm() / ref.norm()).item()


def kv_quantized_perplexity(model_dir: Path, eval_tokens: int) -> tuple[float, float]:
    """SmolLM2 perplexity with fp16 K/V and with K/V through the A3B cache
    (k_proj/v_proj outputs quantized per token and head, as a cache stores them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from a3b_backend.quant.quality import eval_text, perplexity

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer.encode(eval_text())[:eval_tokens])
    head_dim = model.config.hidden_size // model.config.num_attention_heads

    def fp16(_module, _inputs, out):
        return out.half().float()

    def a3b(_module, _inputs, out):
        return a3b_roundtrip(out.reshape(*out.shape[:-1], -1, head_dim), 128).reshape(out.shape)

    results = []
    for hook in (fp16, a3b):
        handles = [getattr(layer.self_attn, p).register_forward_hook(hook)
                   for layer in model.model.layers for p in ("k_proj", "v_proj")]
        results.append(perplexity(model, ids))
        for h in handles:
            h.remove()
    return results[0], results[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results" / "a3b_kv.md")
    args = parser.parse_args(argv)
    from a3b_backend.perf_report import machine

    lines = ["# A3B KV cache (reference path)\n", f"Machine: {machine()}. Command: `make kv-report`.\n",
             "| model | KV dtype | bytes/token/layer | vs fp16 | KV cache at 128K context, all attention layers |",
             "|---|---|---|---|---|"]
    for shape in (QWEN36, SMOLLM2):
        fp16 = bytes_per_token_layer(shape, "fp16")
        for dtype in ("fp16", "fp8", "a3b"):
            b = bytes_per_token_layer(shape, dtype)
            total = b * 131072 * shape.attention_layers / 2**30
            lines.append(f"| {shape.name} | {dtype} | {b:.0f} | {b / fp16:.3f} | {total:.2f} GiB |")
    errors = {t: attention_error(QWEN36, t) for t in (512, 2048)}
    lines += ["", "Attention output, A3B K/V vs fp16 K/V (Qwen3.6 head shape, Gaussian q/k/v, 4 key channels x8): "
              + ", ".join(f"{t} tokens: relative L2 error {e:.4f}" for t, e in errors.items()) + "."]
    print("\n".join(lines), flush=True)
    ppl_fp16, ppl_a3b = kv_quantized_perplexity(args.model, args.eval_tokens)
    lines += ["", f"SmolLM2-135M-Instruct perplexity on {args.eval_tokens} tokens of CPython's language reference "
              f"(weights unquantized): fp16 K/V {ppl_fp16:.3f}, A3B K/V {ppl_a3b:.3f} "
              f"({(ppl_a3b / ppl_fp16 - 1) * 100:+.2f}%)."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
