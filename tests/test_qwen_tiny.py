"""Qwen3.6's architecture at toy width (`make model-qwen`): the checkpoint's
layout, tokenizer and chat template, and vLLM (bf16, our A3B method) against
transformers on the same weights, prefill and decode."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from a3b_backend.profiles import PROJECT_ROOT, get_profile
from a3b_backend.quant.dequantized import float_model
from test_quant_convert import tensors

SOURCE = PROJECT_ROOT / "models" / "qwen3.6-tiny"
QUANTIZED = get_profile("qwen-tiny").resolve_model_dir(PROJECT_ROOT)
PROBE = Path(__file__).with_name("vllm_probe.py")
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "Gated DeltaNet layers keep a fixed-size recurrent state instead of a KV cache.",
    "def fibonacci(n):\n    return n if n < 2 else",
    "Mixture-of-experts routers send each token to eight experts and one shared expert.",
    "北京是中国的首都，上海是",
    "Once upon a time, in a land far away, there lived",
    "SELECT name, count(*) FROM orders GROUP BY",
    "Triton Inference Server streams tokens over gRPC and HTTP",
]
DECODE_STEPS = 16
# vLLM runs bf16 activations (its CPU Gated DeltaNet kernel has no other
# dtype) while the reference runs float32 on the same weights. bf16 keeps 8
# mantissa bits (relative 2^-9 per rounding); through 8 layers of residual
# adds, norms and the delta rule's recurrence that is about 1% of a logit,
# and the logits here have a std of ~4 (qwen_tiny.LOGIT_STD): the typical
# |log p| difference is a few 1e-2 (seen: medians 0.04-0.08, bf16 checkpoint
# above A3B, whose linears accumulate in float32). A broken recurrent state or
# a wrong weight moves every log-prob by units, so the median is the check.
MEDIAN_TOLERANCE = 0.12
# Top-8 of 32 random router logits has near-ties that bf16 breaks the other
# way, and a token routed to another expert moves further (seen: up to 0.75
# on 4-9% of tokens with the uncalibrated checkpoint; with the calibrated one
# `make model-qwen` writes now, 16 of 128 decode steps (12.5%) in one of three
# runs, the others under 12%, vLLM's batch breaking the ties differently from
# run to run): bounded by share.
OUTLIER_TOLERANCE, MAX_OUTLIER_SHARE = 0.35, 0.15


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SOURCE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    if not (SOURCE / ".prepared").exists() or not QUANTIZED.exists():
        pytest.fail(f"{SOURCE} or {QUANTIZED} missing: run `make model-qwen`")
    return [tokenizer().encode(text) for text in PROMPTS]


def test_checkpoint_has_the_published_layout():
    names = set(tensors(SOURCE))
    assert "model.language_model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith("model.layers.") for n in names)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names  # stacked
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names  # Gated DeltaNet
    assert "model.language_model.layers.3.self_attn.q_norm.weight" in names  # full attention every 4th
    assert any(n.startswith("mtp.") for n in names)
    config = json.loads((SOURCE / "config.json").read_text())
    assert config["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert (config["head_dim"], config["linear_key_head_dim"], config["linear_value_head_dim"]) == (256, 128, 128)


def test_conversion_keeps_router_gates_norms_and_mtp():
    stored = tensors(QUANTIZED)
    layer = "model.language_model.layers.0."
    for kept in (f"{layer}mlp.gate.weight", f"{layer}mlp.shared_expert_gate.weight",
                 f"{layer}linear_attn.in_proj_a.weight", f"{layer}linear_attn.in_proj_b.weight",
                 f"{layer}input_layernorm.weight", "model.language_model.embed_tokens.weight"):
        assert kept in stored, kept
    for quantized in (f"{layer}linear_attn.in_proj_qkv.weight", f"{layer}linear_attn.out_proj.weight",
                      f"{layer}mlp.shared_expert.gate_proj.weight", f"{layer}mlp.experts.31.down_proj.weight",
                      "model.language_model.layers.3.self_attn.o_proj.weight"):
        assert f"{quantized}_packed" in stored, quantized
    assert not any(n.startswith("mtp.") and n.endswith("_packed") for n in stored)


def test_tokenizer_has_qwen36_special_tokens_on_qwen3_vocabulary():
    tok = tokenizer()
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"]) == [
        151644, 151645, 151667, 151668, 151657]
    assert tok.decode(tok.encode("Hello, 世界! <think>")) == "Hello, 世界! <think>"


def test_chat_template_renders_qwen36_turns_thinking_and_tools():
    tok = tokenizer()
    user = [{"role": "user", "content": "Weather in Paris?"}]
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    turns = [{"role": "system", "content": "Be brief."}] + user + [
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "tool", "content": "wind 5 km/h"},
    ]
    text = tok.apply_chat_template(turns, tools=[tool], tokenize=False, add_generation_prompt=True)
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
                             "<tools>\n" + json.dumps(tool) + "\n</tools>\n\nIf you choose to call a function")
    assert system.endswith("</IMPORTANT>\n\nBe brief.")  # the caller's system text after the tools
    assert ("<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\nwind 5 km/h\n"
            "</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    # an answered earlier turn drops its reasoning unless preserve_thinking asks to keep it
    history = user + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."},
                      {"role": "user", "content": "And tomorrow?"}]
    assert "Easy." not in tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "<think>\nEasy.\n</think>\n\nSunny.<|im_end|>" in tok.apply_chat_template(
        history, tokenize=False, add_generation_prompt=True, preserve_thinking=True)
    with pytest.raises(Exception, match="system message must be the first"):
        tok.apply_chat_template(user + [{"role": "system", "content": "late"}], tokenize=False)


def vllm_check(checkpoint: Path, prompts: list[list[int]], tmp_path: Path) -> tuple[dict, str]:
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    done = subprocess.run([sys.executable, str(PROBE), "check", str(checkpoint), str(prompts_file),
                           str(DECODE_STEPS)], capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, log[-5000:]
    return json.loads(line[len("RESULT "):]), log


def reference_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, teacher-forced."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def compare(got: list[float], expected: list[float], what: str) -> None:
    diffs = sorted(abs(a - b) for a, b in zip(got, expected))
    median, outliers = diffs[len(diffs) // 2], sum(d > OUTLIER_TOLERANCE for d in diffs)
    summary = f"{what}: median |diff| {median:.3f}, {outliers}/{len(diffs)} above {OUTLIER_TOLERANCE}, max {diffs[-1]:.3f}"
    assert len(got) == len(expected) and median <= MEDIAN_TOLERANCE, summary
    assert outliers <= MAX_OUTLIER_SHARE * len(diffs), summary


@pytest.mark.parametrize("checkpoint", [QUANTIZED, SOURCE], ids=["a3b", "bf16"])
def test_vllm_prefill_and_decode_match_transformers(checkpoint, prompts, tmp_path):
    result, log = vllm_check(checkpoint, prompts, tmp_path)
    model = float_model(checkpoint)
    all_prefill, all_decode = [], []
    for ids, prefill, tokens, decode in zip(prompts, result["prompt_logprobs"], result["greedy"],
                                            result["greedy_logprobs"]):
        all_prefill += list(zip(prefill, reference_logprobs(model, ids)))
        # the recurrent state in vLLM's decode kernel, checked by teacher-forcing vLLM's own tokens
        assert len(tokens) == DECODE_STEPS
        all_decode += list(zip(decode, reference_logprobs(model, ids + tokens)[len(ids) - 1:]))
    compare(*map(list, zip(*all_prefill)), "prefill")
    compare(*map(list, zip(*all_decode)), "decode")
    if checkpoint == QUANTIZED:
        # decode steps (one row per sequence) went through the fused CPU kernel, on the model's bf16
        # activations; the MoE experts take them as float32 (A3BMoEMethod.apply says why)
        for layer_kind, dtype in (("linear", "bfloat16"), ("MoE expert", "float32")):
            assert re.search(rf"A3B {layer_kind}: CPU fused path, {dtype} activations", log), layer_kind
