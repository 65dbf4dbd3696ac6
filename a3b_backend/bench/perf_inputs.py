"""perf_analyzer `--input-data` files: prompts of exact token lengths, cut from
real English text, in both wire flavours (vllm_backend and TensorRT-LLM), plus
the RAG mix (shared system prompt + one long document chunk + a short question).

    python -m a3b_backend.bench.perf_inputs --profile cpu --out perf/inputs/cpu

Token counts are exact under the served model's tokenizer as preprocessing
counts them (`encode(text, add_special_tokens=True)`, no chat template), so the
server's `num_input_tokens` equals the requested length.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

from a3b_backend.profiles import LICENCE_TEXTS, PROJECT_ROOT, Profile, get_profile
from a3b_backend.prepare.qwen_vocab import QWEN_PATTERN, vocab_file

FLAVOURS = ("vllm", "trtllm")
RAG_SYSTEM_PROMPT = (
    "You are a careful assistant. Answer the question using only the document below. "
    "If the document does not contain the answer, say so.\n\nDocument:\n"
)
RAG_QUESTIONS = (
    "Summarize the document's main point in one sentence.",
    "Which obligations does the document place on the reader?",
    "Name two terms the document defines.",
    "What does the document say about exceptions?",
)


class TokenCodec(Protocol):
    """How inputs are cut to exact token counts: the served model's tokenizer
    (HFTokenizer) or, where its checkpoint is absent, Qwen's BPE (QwenTokenizer)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class InputError(ValueError):
    """A requested input the profile cannot serve (e.g. a prompt over its context)."""


@dataclasses.dataclass
class HFTokenizer:
    """The served model's tokenizer, counting tokens as preprocessing does."""
    inner: Any

    @classmethod
    def load(cls, model_dir: Path) -> "HFTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir))

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)


@dataclasses.dataclass
class QwenTokenizer:
    """The Qwen BPE vocabulary shipped in the `dashscope` package, for profiles
    whose checkpoint is not on this machine."""
    inner: Any

    @classmethod
    def load(cls) -> "QwenTokenizer":
        import tiktoken

        ranks = {base64.b64decode(token): int(rank)
                 for token, rank in (line.split() for line in vocab_file().read_text().splitlines() if line)}
        return cls(tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens={}))

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, errors="ignore")


def tokenizer_for(profile: Profile, project_root: Path) -> TokenCodec:
    model_dir = profile.resolve_model_dir(project_root)
    if (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists():
        return HFTokenizer.load(model_dir)
    return QwenTokenizer.load()


def prose_lines(text: str) -> str:
    """Drops table borders, grammar rules and code: lines mostly not letters."""
    def is_prose(line: str) -> bool:
        body = line.strip()
        return not body or sum(c.isalpha() or c == " " for c in body) >= 0.85 * len(body)
    return "\n".join(line.strip() for line in text.splitlines() if is_prose(line))


def corpus_text() -> str:
    """Real English prose every machine with Python has: the Python language
    reference (pydoc_data) followed by the system's license texts."""
    import pydoc_data.topics

    parts = [text for _, text in sorted(pydoc_data.topics.topics.items())]
    if LICENCE_TEXTS.is_dir():
        parts += [p.read_text(errors="ignore") for p in sorted(LICENCE_TEXTS.iterdir()) if p.is_file()]
    return re.sub(r"\n{3,}", "\n\n", "\n\n".join(prose_lines(part) for part in parts))


class Corpus:
    """The corpus as one token ring: prompt i starts at its own offset, and a
    window longer than the corpus wraps around."""

    def __init__(self, tokenizer: TokenCodec, text: str | None = None):
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(text if text is not None else corpus_text())

    def window(self, start: int, count: int) -> list[int]:
        n = len(self.ids)
        start %= n
        out = self.ids[start:start + count]
        while len(out) < count:
            out += self.ids[: count - len(out)]
        return out

    def text_of_length(self, length: int, start: int = 0) -> str:
        """Corpus text that is exactly `length` tokens. Decoding a token window and
        encoding it again can merge or split tokens at the seams, so the window
        is resized until the string itself counts right; where a seam keeps
        flipping between one token too few and one too many, the window moves
        on by a token."""
        for shift in range(16):
            count = length
            for _ in range(4):
                text = self.tokenizer.decode(self.window(start + shift, max(count, 1)))
                got = len(self.tokenizer.encode(text))
                if got == length:
                    return text
                count += length - got
        raise InputError(f"could not cut a prompt of exactly {length} tokens from the corpus at offset {start}")


def check_length(profile: Profile, prompt_tokens: int, output_tokens: int) -> None:
    if prompt_tokens < 1:
        raise InputError(f"prompt length {prompt_tokens} tokens: must be at least 1")
    if prompt_tokens + output_tokens > profile.max_model_len:
        raise InputError(
            f"prompt length {prompt_tokens} + {output_tokens} output tokens exceeds profile "
            f"{profile.name!r} context of {profile.max_model_len} tokens (max_model_len); "
            f"the longest prompt it can take is {profile.max_model_len - output_tokens}")


def request_entry(flavour: str, prompt: str, output_tokens: int, stream: bool = True) -> dict[str, list]:
    """One perf_analyzer data entry; both flavours force exactly `output_tokens`."""
    if flavour == "vllm":
        sampling = {"temperature": 0, "max_tokens": output_tokens, "ignore_eos": True}
        return {"text_input": [prompt], "stream": [stream], "exclude_input_in_output": [True],
                "sampling_parameters": [json.dumps(sampling)]}
    if flavour == "trtllm":
        return {"text_input": [prompt], "stream": [stream], "max_tokens": [output_tokens],
                "min_tokens": [output_tokens], "temperature": [0.0]}
    raise InputError(f"unknown request flavour {flavour!r}; known: {', '.join(FLAVOURS)}")


def fixed_length_data(corpus: Corpus, profile: Profile, length: int, output_tokens: int, flavour: str,
                      count: int) -> dict[str, list]:
    check_length(profile, length, output_tokens)
    stride = max(1, len(corpus.ids) // max(count, 1))
    prompts = [corpus.text_of_length(length, start=i * stride) for i in range(count)]
    return {"data": [request_entry(flavour, p, output_tokens) for p in prompts]}


def rag_data(corpus: Corpus, profile: Profile, document_tokens: int, output_tokens: int, flavour: str,
             count: int) -> dict[str, list]:
    """Every request shares the system prompt and the same document chunk (what
    prefix caching can reuse) and asks its own short question."""
    document = corpus.tokenizer.decode(corpus.window(0, document_tokens))
    entries = []
    for i in range(count):
        prompt = f"{RAG_SYSTEM_PROMPT}{document}\n\nQuestion: {RAG_QUESTIONS[i % len(RAG_QUESTIONS)]}\nAnswer:"
        check_length(profile, len(corpus.tokenizer.encode(prompt)), output_tokens)
        entries.append(request_entry(flavour, prompt, output_tokens))
    return {"data": entries}


def input_files(profile: Profile, corpus: Corpus,
                flavours: Iterable[str] = FLAVOURS) -> Iterator[tuple[str, dict]]:
    """(file name, perf_analyzer input data) for every length of the profile's perf plan, then the RAG mix."""
    plan = profile.perf
    for flavour in flavours:
        for length in plan.prompt_lengths:
            yield input_file_name(length, flavour), fixed_length_data(
                corpus, profile, length, plan.output_tokens, flavour, plan.prompts_per_file)
        yield f"rag{plan.rag_document_tokens}_{flavour}.json", rag_data(
            corpus, profile, plan.rag_document_tokens, plan.output_tokens, flavour, plan.prompts_per_file)


def input_file_name(length: int, flavour: str) -> str:
    return f"len{length}_{flavour}.json"


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="deployment profile (default: $A3B_PROFILE or cpu)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON files")
    parser.add_argument("--length", type=int, action="append",
                        help="prompt length in tokens (repeatable); default: the profile's perf plan")
    parser.add_argument("--flavour", choices=FLAVOURS, action="append", help="default: both")
    args = parser.parse_args(argv)
    profile = get_profile(args.profile)
    if args.length:
        profile = dataclasses.replace(profile, perf=dataclasses.replace(profile.perf,
                                                                        prompt_lengths=tuple(args.length)))
    try:
        for length in profile.perf.prompt_lengths:
            check_length(profile, length, profile.perf.output_tokens)
        corpus = Corpus(tokenizer_for(profile, PROJECT_ROOT))
        args.out.mkdir(parents=True, exist_ok=True)
        flavours = args.flavour or FLAVOURS
        total = len(flavours) * (len(profile.perf.prompt_lengths) + 1)
        for name, data in tqdm(input_files(profile, corpus, flavours), total=total, desc="inputs", unit="file"):
            (args.out / name).write_text(json.dumps(data))
    except InputError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {total} files to {args.out}")


if __name__ == "__main__":
    main()
