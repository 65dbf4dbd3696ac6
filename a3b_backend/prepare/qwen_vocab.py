"""Qwen's BPE vocabulary as the `dashscope` package ships it (151,643 ranks,
tiktoken format), with Qwen's pre-tokenizer split: what qwen-tiny's tokenizer is
built from, and what perf inputs count tokens with when a Qwen profile's
checkpoint is not on this machine. Imports nothing heavy."""
from __future__ import annotations

import importlib.resources
from importlib.abc import Traversable

# Qwen's pre-tokenizer split (its tiktoken pattern)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def vocab_file() -> Traversable:
    """The tiktoken ranks file: one `base64(token) rank` per line."""
    return importlib.resources.files("dashscope") / "resources" / "qwen.tiktoken"
