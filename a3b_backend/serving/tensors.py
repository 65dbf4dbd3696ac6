"""The request path's shared vocabulary for tensors: the client error type and
the STRING tensor codec. Pure numpy, so request parsing is tested without Triton."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


class RequestError(ValueError):
    """A client error: the message is sent back to the caller as it is."""


def scalar(tensors: Mapping[str, np.ndarray], name: str) -> Any:
    """The one value of a [1] tensor (None when absent)."""
    arr = tensors.get(name)
    if arr is None:
        return None
    if arr.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def decode_utf8(raw: Any, name: str) -> str:
    """One element of a STRING tensor as text."""
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            f"input '{name}' is not valid UTF-8 (byte {exc.start}: {bytes(raw)[exc.start:exc.start + 4]!r})"
        ) from None


def string_value(tensors: Mapping[str, np.ndarray], name: str) -> str:
    """A [1] STRING tensor as text ("" when absent)."""
    value = scalar(tensors, name)
    return "" if value is None else decode_utf8(value, name)


def string_tensor(text: str) -> np.ndarray:
    """Text as a [1] STRING tensor (UTF-8 bytes)."""
    return np.array([text.encode("utf-8")], dtype=np.object_)
