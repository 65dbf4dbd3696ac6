"""Reasoning and tool-call separation with vLLM's own parsers (the profile names
them: `reasoning_parser`, `tool_parser`), one step of generated text at a time.

The parser state lives in a3b_llm, one `ChatParser` per request beside its step
tracker: vLLM's parsers are stateful (where the think block ends, which tool
call is open, how much of its arguments went out) and read every delta in
order, while postprocessing is stateless per step and sees only a short
window of tokens. a3b_llm sends each step's parsed pieces downstream.

Streaming and non-streaming give the same result, equal to vLLM's
`Parser.parse` of the whole text up to the answer's surrounding whitespace:
`parse` strips it when a tool call follows and keeps it otherwise, which a
stream cannot know in advance, so the answer is always stripped (trailing
whitespace is held back until more answer follows). Tool calls are sent once,
complete, with the final response.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from a3b_backend.serving.tensors import RequestError


@dataclasses.dataclass
class ParsedStep:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None  # on the final step, when tool calls are parsed


@functools.cache
def parser_class(reasoning_parser: str | None, tool_parser: str | None, tokenizer: Any):
    from vllm.parser.parser_manager import ParserManager

    return ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name=reasoning_parser,
                                    enable_auto_tools=tool_parser is not None, tokenizer=tokenizer)


class ChatParser:
    """One request's reasoning / answer / tool-call separation."""

    def __init__(self, parser_cls: Any, tokenizer: Any, prompt_ids: list[int], tools: list[dict] | None,
                 chat_template_kwargs: dict[str, Any]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            # the parser reads tool definitions and tool_choice from an OpenAI request
            self._request = ChatCompletionRequest(model="a3b", messages=[{"role": "user", "content": ""}],
                                                  tools=tools or None)
        except ValueError as exc:
            raise RequestError(f"input 'tools' is not a valid OpenAI tool list: {exc}") from None
        self._parser = parser_cls(tokenizer, self._request.tools, chat_template_kwargs=chat_template_kwargs)
        self._parser.set_prompt_token_ids(prompt_ids)
        self._prompt_ids = prompt_ids
        self._started = False  # answer text seen (leading whitespace is dropped before it)
        self._held = ""  # trailing whitespace of the answer so far
        self._calls: dict[int, dict[str, Any]] = {}

    def step(self, delta_text: str, delta_ids: list[int], finished: bool) -> ParsedStep:
        delta = self._parser.parse_delta(delta_text, delta_ids, self._request, prompt_token_ids=self._prompt_ids,
                                         finished=finished)
        parsed = ParsedStep()
        if delta is not None:
            parsed.reasoning = delta.reasoning or ""
            parsed.content = self._answer(delta.content or "")
            for call in delta.tool_calls:
                self._add(call)
        if finished:
            self._held = ""
            parsed.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        return parsed

    def _answer(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body

    def _add(self, call: Any) -> None:
        entry = self._calls.setdefault(call.index, {"id": "", "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
        entry["id"] = call.id or entry["id"]
        if call.function is not None:
            entry["function"]["name"] += call.function.name or ""
            entry["function"]["arguments"] += call.function.arguments or ""


def tool_calls_json(calls: list[dict[str, Any]] | None) -> str:
    return "" if calls is None else json.dumps(calls)
