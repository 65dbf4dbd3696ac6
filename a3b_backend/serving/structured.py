"""Structured outputs in both wire forms -> one checked constraint, the fields of
vLLM's `StructuredOutputsParams`.

- vllm_backend: `sampling_parameters.structured_outputs`, an object or a JSON
  string of one (Triton's OpenAI frontend and vllm_backend send the string of
  the whole dataclass: null fields and keys starting with `_` are ignored).
- TensorRT-LLM: `guided_decoding_guide_type` (`json`, `json_schema`, `regex`,
  `ebnf_grammar`) with `guided_decoding_guide`.

Every constraint is compiled here with xgrammar, the library vLLM's default
structured-output backend compiles it with, so an invalid schema, regex or
grammar is refused with its reason before any generation.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from a3b_backend.serving.tensors import RequestError

Constraint = Literal["json", "regex", "choice", "grammar", "json_object"]
CONSTRAINTS: tuple[Constraint, ...] = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# Older vLLM's GuidedDecodingParams fields that pick vLLM's own backend: the
# engine's configured backend is used, so they are dropped.
BACKEND_CHOICE = ("backend", "backend_was_auto", "disable_fallback")
# TensorRT-LLM guide type -> constraint
GUIDE_TYPES: dict[str, Constraint] = {"json": "json_object", "json_schema": "json", "regex": "regex",
                                      "ebnf_grammar": "grammar"}
WHERE_SAMPLING = "parameter 'structured_outputs'"


def from_sampling(value: Any) -> dict[str, Any]:
    """sampling_parameters.structured_outputs -> the checked constraint."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{WHERE_SAMPLING} is a string but not valid JSON: {exc.msg} at char {exc.pos}") from None
    if not isinstance(value, dict):
        raise RequestError(f"{WHERE_SAMPLING} must be an object (or a JSON string of one) with one of "
                           f"{', '.join(CONSTRAINTS)}; got {type(value).__name__}")
    fields = {k: v for k, v in value.items() if v is not None and not k.startswith("_") and k not in BACKEND_CHOICE}
    unknown = sorted(set(fields) - set(CONSTRAINTS) - set(OPTIONS))
    if unknown:
        raise RequestError(f"{WHERE_SAMPLING} has unknown key(s) {', '.join(unknown)}; allowed: "
                           f"{', '.join(CONSTRAINTS + OPTIONS)}")
    if fields.get("json_object") is False:
        del fields["json_object"]
    return check(fields, WHERE_SAMPLING)


def from_guide(guide_type: str, guide: str | None) -> dict[str, Any]:
    """TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide -> the checked constraint."""
    constraint = GUIDE_TYPES.get(guide_type)
    if constraint is None:
        raise RequestError(f"input 'guided_decoding_guide_type' = {guide_type!r} is not supported; allowed: "
                           f"{', '.join(GUIDE_TYPES)}")
    where = f"input 'guided_decoding_guide' ({guide_type})"
    if constraint == "json_object":
        return check({"json_object": True}, where)
    if not guide:
        raise RequestError(f"input 'guided_decoding_guide_type' = {guide_type!r} needs 'guided_decoding_guide' "
                           f"(the {constraint} to follow)")
    return check({constraint: guide}, where)


def check(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """Exactly one constraint, compiled; options passed along. Returns the normalized fields."""
    given = [c for c in CONSTRAINTS if c in fields]
    if len(given) != 1:
        raise RequestError(f"{where} needs exactly one of {', '.join(CONSTRAINTS)}; got "
                           f"{', '.join(given) or 'none'}")
    kind = given[0]
    out = dict(fields)
    out[kind] = _compiled(kind, fields[kind], where)
    return out


def _compiled(kind: Constraint, value: Any, where: str) -> Any:
    from xgrammar import Grammar

    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            Grammar.from_json_schema(json.dumps(schema))
            return schema
        if kind == "json_object":
            if value is not True:
                raise ValueError("json_object must be true")
            return True
        if kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return value
        if not isinstance(value, str) or not value:
            raise ValueError(f"a {kind} must be a non-empty string")
        (Grammar.from_regex if kind == "regex" else Grammar.from_ebnf)(value)
        return value
    except json.JSONDecodeError as exc:
        raise RequestError(f"{where}: the JSON schema is not valid JSON: {exc.msg} at char {exc.pos}") from None
    except (RuntimeError, ValueError) as exc:
        raise RequestError(f"{where}: invalid {kind}: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp and source location."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
