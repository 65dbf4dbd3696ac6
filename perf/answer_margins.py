"""make answer-margins: how each checkpoint answers in chat, the register the server serves.

1. Answers: for each prompt (the chat prompt the served tests send, and the ones tried beside it),
   each checkpoint answers greedily through the chat template, as the server does; the report gives
   each answer and its margin: the smallest gap, in nats, between the top two next-token
   log-probabilities along the answer up to the word the tests look for. A 4-bit checkpoint moves
   the logits by more than a few tenths of a nat, so an answer whose margin is smaller in bf16 is a
   coin flip between calibration texts, not a test of the server.
2. The chat register: the first checkpoint's (bf16's) own greedy answers, CHAT_TOKENS each, to
   those prompts and to "Summarize in one sentence:" requests over paragraphs of the prose register
   (the standard library's docstrings, which no calibration text holds); each checkpoint's
   perplexity on those answers and how often its top next token is the one bf16 chose.

Runs in transformers (float32, A3B weights dequantized: a3b_backend/quant/dequantized.py).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from a3b_backend.bench.perf_report import machine
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant.dequantized import float_model
from a3b_backend.quant.quality import prose_text

MODEL = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
OUT = PROJECT_ROOT / "perf" / "results" / "answer_margins"
EXPECTED = "Paris"
PROMPTS = (
    "What is the capital of France?",
    "Which city is the capital of France?",
    "What city is the capital of France?",
    "Name the capital of France.",
    "Tell me the capital of France.",
    "What is the capital of France? Answer in a full sentence.",
)
NEW_TOKENS = 16
SUMMARIZED_PARAGRAPHS, PARAGRAPH_CHARS, CHAT_TOKENS = 24, 400, 48


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    """`prompt` as one user turn in the model's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)])


@torch.no_grad()
def answer(model, tokenizer, prompt: str) -> dict:
    """The greedy answer to `prompt` as one chat turn, and its smallest top-two margin up to EXPECTED."""
    ids = chat_ids(tokenizer, prompt)
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    generated = out.sequences[0, ids.shape[1]:].tolist()
    margins = [float(top[0] - top[1]) for top in (s[0].log_softmax(-1).topk(2).values for s in out.scores)]
    upto = next((i + 1 for i in range(len(generated)) if EXPECTED in tokenizer.decode(generated[:i + 1])),
                len(generated))
    return {"answer": tokenizer.decode(generated, skip_special_tokens=True), "margin": min(margins[:upto]),
            "expected_found": upto < len(generated) or EXPECTED in tokenizer.decode(generated)}


def chat_prompts() -> list[str]:
    return [*PROMPTS, *(f"Summarize in one sentence: {paragraph[:PARAGRAPH_CHARS]}"
                        for paragraph in prose_text().split("\n\n")[:SUMMARIZED_PARAGRAPHS])]


@torch.no_grad()
def reference_answers(model, tokenizer) -> list[tuple[int, torch.Tensor]]:
    """(prompt length, prompt and greedy answer) for each chat prompt."""
    answers = []
    for prompt in chat_prompts():
        ids = chat_ids(tokenizer, prompt)
        answers.append((ids.shape[1], model.generate(ids, max_new_tokens=CHAT_TOKENS, do_sample=False)))
    return answers


@torch.no_grad()
def chat_register(model, answers: list[tuple[int, torch.Tensor]]) -> dict:
    """`model`'s perplexity on the reference answers and its top-1 agreement with them."""
    nll, agree, count = 0.0, 0, 0
    for prompt_length, sequence in answers:
        logprobs = model(sequence).logits[0, prompt_length - 1:-1].log_softmax(-1)
        target = sequence[0, prompt_length:]
        nll -= float(logprobs.gather(1, target[:, None]).sum())
        agree += int((logprobs.argmax(-1) == target).sum())
        count += target.numel()
    return {"perplexity": math.exp(nll / count), "top1_agreement": agree / count, "tokens": count}


def write_report(rows: list[dict], register: dict[str, dict], checkpoints: list[str], command: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "answer_margins.json").write_text(json.dumps({"machine": machine(), "rows": rows,
                                                         "chat_register": register}, indent=2))
    lines = ["# Chat answers of the default model's checkpoints (`make answer-margins`)", "",
             f"Machine: {machine()}. Command: `{command}`. Margin: the smallest gap in nats between the top two "
             f"next tokens along the greedy answer, up to '{EXPECTED}'. Transformers, float32, A3B weights "
             "dequantized.", "",
             "| prompt | " + " | ".join(checkpoints) + " |", "|---|" + "---|" * len(checkpoints)]
    for prompt in PROMPTS:
        cells = []
        for name in checkpoints:
            row = next(r for r in rows if r["prompt"] == prompt and r["checkpoint"] == name)
            cells.append(f"{row['margin']:.2f}{'' if row['expected_found'] else ' (no ' + EXPECTED + ')'}: "
                         f"{row['answer'][:48]!r}")
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    tokens = next(iter(register.values()))["tokens"]
    lines += ["", f"## The chat register: {checkpoints[0]}'s own greedy answers", "",
              f"{len(chat_prompts())} prompts (the {len(PROMPTS)} above and {SUMMARIZED_PARAGRAPHS} 'Summarize in "
              f"one sentence:' requests over prose-register paragraphs), {CHAT_TOKENS} answer tokens each, "
              f"{tokens} in all.", "",
              "| checkpoint | perplexity on the answers | top-1 agreement |", "|---|---|---|"]
    lines += [f"| {name} | {r['perplexity']:.3f} | {r['top1_agreement']:.1%} |" for name, r in register.items()]
    (OUT / "answer_margins.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", type=Path, nargs="*", default=[MODEL, Path(f"{MODEL}-a3b")],
                        help="model directories; the first (bf16) gives the chat register's answers")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows, register, answers = [], {}, None
    for checkpoint in args.checkpoints:
        model = float_model(checkpoint)
        for prompt in PROMPTS:
            rows.append({"checkpoint": checkpoint.name, "prompt": prompt, **answer(model, tokenizer, prompt)})
            print(f"{checkpoint.name}: {prompt!r} -> {rows[-1]['answer']!r} (margin {rows[-1]['margin']:.2f})",
                  flush=True)
        answers = answers or reference_answers(model, tokenizer)
        register[checkpoint.name] = chat_register(model, answers)
        print(f"{checkpoint.name}: chat register {register[checkpoint.name]}", flush=True)
    command = "perf/answer_margins.py " + " ".join(str(c.relative_to(PROJECT_ROOT) if c.is_relative_to(PROJECT_ROOT)
                                                       else c) for c in args.checkpoints)
    write_report(rows, register, [c.name for c in args.checkpoints], command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
