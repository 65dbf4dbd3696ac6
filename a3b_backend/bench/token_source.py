"""What perf/serving_path.py and the token source it serves (perf/token_source/model.py) agree on."""
from __future__ import annotations

from typing import Literal

# how the source sends a stream's tokens (the token source's docstring says what each does)
Sending = Literal["paced", "coalesced", "per-token"]
SENDING_ENV = "A3B_TOKEN_SOURCE_SENDING"
SENDING_DESCRIPTIONS: dict[Sending, str] = {
    "paced": "paced as a3b_llm sends: the profile's gap between a stream's responses, its tokens due meanwhile in one",
    "coalesced": "unpaced: a stream's tokens due while sending fell behind in one response",
    "per-token": "one response per token",
}
