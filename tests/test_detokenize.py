"""Stateless windowed detokenizing: stream pieces must concatenate to the full decode."""
import random

import pytest

from a3b_backend.serving.detokenize import DecodeRule, settled, text_delta

TEXTS = [
    "The capital of France is Paris.",
    "北京是中国的首都，上海是最大的城市。",
    "Emoji: 🎉🚀👩‍👩‍👧 and café, naïve, Ωmega",
    "mixed 日本語 text with 🍣 sushi and ASCII",
]


def stream(tokenizer, ids, rule, chunks, stopped_by=None):
    pieces, generated, i = [], [], 0
    while i < len(ids):
        n = chunks[len(pieces) % len(chunks)]
        new = ids[i:i + n]
        i += n
        context = generated[-rule.context_tokens:]
        pieces.append(text_delta(tokenizer, context, new, rule, final=i >= len(ids), stopped_by=stopped_by))
        generated.extend(new)
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [[1], [2, 1, 3]])
def test_pieces_concatenate_to_full_decode_and_are_valid_utf8(tokenizer, text, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    rule = DecodeRule()
    pieces = stream(tokenizer, ids, rule, chunks)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")


def test_random_byte_level_ids_never_split_characters(tokenizer):
    rng = random.Random(0)
    source = "".join(TEXTS)
    for _ in range(20):
        start = rng.randrange(len(source) - 20)
        ids = tokenizer.encode(source[start:start + rng.randrange(5, 40)], add_special_tokens=False)
        pieces = stream(tokenizer, ids, DecodeRule(), [1])
        assert "".join(pieces) == tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def test_stop_string_is_held_back_and_cut(tokenizer):
    all_ids = tokenizer.encode("one two three STOP four", add_special_tokens=False)
    # The engine ends the stream on the token that completes the stop string.
    ids = next(all_ids[:n] for n in range(1, len(all_ids) + 1) if "STOP" in tokenizer.decode(all_ids[:n]))
    rule = DecodeRule(stop=("STOP",))
    pieces = stream(tokenizer, ids, rule, [1], stopped_by="STOP")
    assert "".join(pieces) == "one two three "
    included = stream(tokenizer, ids, DecodeRule(stop=("STOP",), include_stop_str_in_output=True), [1], "STOP")
    assert "".join(included) == "one two three STOP"


def test_settled_holds_partial_characters_and_stop_prefixes():
    assert settled("abc\ufffd", DecodeRule()) == "abc"
    assert settled("hello ST", DecodeRule(stop=("STOP",))) == "hello "
    assert settled("hello S", DecodeRule(stop=("XYZ",))) == "hello S"
