"""How often one stream may send a response, so that all streams together stay
within what the serving path carries.

Every response a3b_llm sends is a postprocessing request and a client response
through the ensemble; past the path's rate (make bench-serving-path) the
responses queue and every stream falls behind at once. So each stream waits
`gap_s` between its responses, and vLLM's output collector merges the tokens
produced meanwhile into the next one (the concatenated text is unchanged).
Below the budget the gap is shorter than a stream's own step and nothing waits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator, Callable


@dataclasses.dataclass(frozen=True)
class ResponsePacing:
    # responses per second the serving path carries without queueing (the profile's)
    responses_per_s: float

    def gap_s(self, streams: int) -> float:
        """The least time between two responses of one stream while `streams` stream."""
        return max(streams, 1) / self.responses_per_s

    def wait_s(self, streams: int, last_sent_s: float, now_s: float) -> float:
        """How long a stream that last sent at `last_sent_s` waits before its next response."""
        return max(0.0, last_sent_s + self.gap_s(streams) - now_s)


async def paced(outputs: AsyncIterator[Any], pacing: ResponsePacing, streams: Callable[[], int]) -> AsyncIterator[Any]:
    """`outputs` (one request's vLLM outputs, DELTA) with the pacing gap kept
    between the moments they are handed on: while this waits, vLLM merges the
    outputs produced meanwhile into the next. `streams` counts the streams now."""
    async for output in outputs:
        handed_on = time.monotonic()
        yield output
        if not output.finished:
            await asyncio.sleep(pacing.wait_s(streams(), handed_on, time.monotonic()))
