"""Prompts on which a quantized model's greedy answers are compared with bf16's (bench-a3b, compare-quant)."""
from __future__ import annotations

PROMPTS = 50


def opening_prompts(tokenizer, count: int = PROMPTS) -> list[list[int]]:
    """`count` natural-language openings of ~48 tokens from CPython's language reference."""
    from a3b_backend.quant.quality import eval_text

    words = eval_text().split()
    step = len(words) // count
    return [tokenizer.encode(" ".join(words[i * step: i * step + 36])) for i in range(count)]
