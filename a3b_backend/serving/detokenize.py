"""Stateless, UTF-8-safe incremental detokenizing.

The postprocessing model runs once per engine step and keeps no state, so each
step carries a window of the tokens generated before it (`context_ids`) next to
the new ones. The new text is the difference between the decode of the window
with and without the new tokens, where text that may still change is held back:
a trailing incomplete UTF-8 character (decoded as U+FFFD) or a tail that could
be the start of a stop string. The window is long enough to hold everything
held back, so the pieces of a stream concatenate to exactly the full decode.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Tokens before the new ones that must travel with each step: a partial UTF-8
# character spans at most 3 byte-tokens; stop strings add their length.
BASE_CONTEXT_TOKENS = 6


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...) -> str: ...


@dataclasses.dataclass(frozen=True)
class DecodeRule:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def from_params(cls, params: dict) -> "DecodeRule":
        """From vLLM-style sampling parameters (or the postprocess config that carries them)."""
        return cls(
            stop=tuple(params.get("stop", ())),
            include_stop_str_in_output=params.get("include_stop_str_in_output", False),
            skip_special_tokens=params.get("skip_special_tokens", True),
        )

    @property
    def context_tokens(self) -> int:
        return BASE_CONTEXT_TOKENS + max((len(s) for s in self.stop), default=0)


def _decode(tokenizer: Tokenizer, ids: Sequence[int], rule: DecodeRule) -> str:
    # No clean-up of tokenization spaces: it rewrites text across token
    # boundaries, which would make a piece depend on what follows it.
    return tokenizer.decode(list(ids), skip_special_tokens=rule.skip_special_tokens, clean_up_tokenization_spaces=False)


def settled(text: str, rule: DecodeRule) -> str:
    """The part of a not-yet-final decode that can no longer change."""
    text = text.rstrip(REPLACEMENT_CHAR)
    held = 0
    for stop in rule.stop:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return text[: len(text) - held]


def finished(text: str, rule: DecodeRule, stopped_by: str | None) -> str:
    """The decode at the end of a stream: cut at the stop string that ended it."""
    at = text.find(stopped_by) if stopped_by else -1
    if at < 0:
        return text
    return text[: at + len(stopped_by)] if rule.include_stop_str_in_output else text[:at]


def text_delta(
    tokenizer: Tokenizer,
    context_ids: Sequence[int],
    new_ids: Sequence[int],
    rule: DecodeRule,
    final: bool,
    stopped_by: str | None = None,
) -> str:
    """New text of one step, given the window of tokens generated before it."""
    before = settled(_decode(tokenizer, context_ids, rule), rule) if context_ids else ""
    full = _decode(tokenizer, [*context_ids, *new_ids], rule)
    after = finished(full, rule, stopped_by) if final else settled(full, rule)
    if after.startswith(before):
        return after[len(before):]
    common = len(os.path.commonprefix([before, after]))
    return after[common:]
