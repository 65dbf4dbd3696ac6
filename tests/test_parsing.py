"""Reasoning / tool-call separation (a3b_backend/serving/parsing.py) with vLLM's Qwen3.6
parsers on qwen-tiny's tokenizer and template: streamed one token at a time,
in uneven chunks and all at once, against vLLM's parse of the whole text."""
from __future__ import annotations

import json

import numpy as np
import pytest

from a3b_backend.serving.parsing import ChatParser, parser_class
from a3b_backend.serving.preprocess import prepare
from a3b_backend.profiles import PROJECT_ROOT, get_profile
from a3b_backend.serving.sampling import Limits
from a3b_backend.serving.tensors import RequestError

QWEN = get_profile("qwen-tiny")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# what the model writes after the template's "<think>\n"
ANSWERS = {
    "reasoning, answer and a tool call": "The user wants the weather; I will call the tool.\n</think>\n\nLet me check."
                                         "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                         "</parameter>\n</function>\n</tool_call>",
    "reasoning and answer": "Simple question.\n</think>\n\nParis is the capital of France, 北京 of China.",
    "unfinished reasoning": "Still thinking about 🎉 and more",
}


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN.resolve_model_dir(PROJECT_ROOT))


def run(tokenizer, ids: list[int], prompt: list[int], chunk: int) -> tuple[str, str, list]:
    parser = ChatParser(parser_class(QWEN.reasoning_parser, QWEN.tool_parser, tokenizer), tokenizer, prompt, [TOOL], {})
    reasoning = content = ""
    calls, previous = None, ""
    for start in range(0, len(ids), chunk):
        finished = start + chunk >= len(ids)
        text = tokenizer.decode(ids[:start + chunk])
        if text.endswith("\ufffd") and not finished:  # as vLLM's detokenizer: whole characters only
            text = previous
        step = parser.step(text[len(previous):], ids[start:start + chunk], finished=finished)
        previous = text
        reasoning, content, calls = reasoning + step.reasoning, content + step.content, step.tool_calls
    return reasoning, content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("answer", ANSWERS, ids=list(ANSWERS))
def test_streamed_and_whole_parsing_equal_vllms_parse(qwen_tokenizer, answer):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    text = ANSWERS[answer]
    prompt = qwen_tokenizer.encode(qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL], tokenize=False, add_generation_prompt=True))
    ids = qwen_tokenizer.encode(text)
    results = {chunk: run(qwen_tokenizer, ids, prompt, chunk) for chunk in (1, 3, len(ids))}
    assert results[1] == results[3] == results[len(ids)]
    vllm_parser = parser_class(QWEN.reasoning_parser, QWEN.tool_parser, qwen_tokenizer)(qwen_tokenizer, None)
    vllm_parser.set_prompt_token_ids(prompt)
    request = ChatCompletionRequest(model="a3b", messages=[{"role": "user", "content": ""}], tools=[TOOL])
    reasoning, content, calls = vllm_parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)
    expected_calls = [(c.name, json.loads(c.arguments)) for c in calls or []]
    # the answer without surrounding whitespace: parse strips it only when a tool call follows,
    # which a stream cannot know in advance (parsing.py)
    assert results[1] == (reasoning or "", (content or "").strip(), expected_calls)


def test_reasoning_is_refused_on_a_profile_without_parsers(tokenizer):
    tensors = {"text_input": np.array([b"hi"], dtype=object), "return_reasoning": np.array([True])}
    with pytest.raises(RequestError, match="'return_reasoning' is true but the served profile has no reasoning parser"):
        prepare(tensors, tokenizer, Limits(max_model_len=8192, default_max_tokens=16))
