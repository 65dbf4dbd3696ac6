"""Response pacing (a3b_backend/serving/pacing.py): the gap's arithmetic, the waits of
`paced` on a hand-made stream, and on vLLM's own AsyncLLM that the outputs
produced during a wait arrive merged, with the same tokens."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from a3b_backend.serving.pacing import ResponsePacing, paced
from test_vllm_a3b import llama, probe  # noqa: F401 (llama: a fixture)


def test_gap_shares_the_budget_among_streams():
    pacing = ResponsePacing(responses_per_s=1000.0)
    assert pacing.gap_s(1) == pytest.approx(0.001)
    assert pacing.gap_s(250) == pytest.approx(0.25)
    assert pacing.gap_s(0) == pacing.gap_s(1)


def test_wait_is_what_is_left_of_the_gap():
    pacing = ResponsePacing(responses_per_s=100.0)  # 4 streams: 40 ms
    assert pacing.wait_s(4, last_sent_s=10.0, now_s=10.01) == pytest.approx(0.03)
    assert pacing.wait_s(4, last_sent_s=10.0, now_s=10.05) == 0.0


@dataclass
class _Output:
    finished: bool


async def _ready_outputs(count: int):
    for i in range(count):
        yield _Output(finished=i == count - 1)


def test_paced_keeps_the_gap_and_does_not_wait_after_the_last():
    pacing = ResponsePacing(responses_per_s=20.0)  # one stream: 50 ms

    async def run():
        stamps = []
        async for _ in paced(_ready_outputs(3), pacing, lambda: 1):
            stamps.append(time.monotonic())
        return stamps, time.monotonic()

    stamps, done = asyncio.run(run())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert all(g >= 0.05 for g in gaps), gaps
    assert done - stamps[-1] < 0.03


def test_paced_vllm_stream_merges_outputs_into_the_same_tokens(llama):  # noqa: F811 (the fixture)
    _, model_dir = llama
    result, log = probe("paced", model_dir, "48")
    assert result is not None, log[-4000:]
    unpaced, paced_outputs = result["unpaced"], result["paced"]
    assert sum(unpaced, []) == sum(paced_outputs, [])
    assert len(sum(unpaced, [])) == 48
    # 48 tokens in far fewer outputs: each carries the tokens of several steps
    assert len(paced_outputs) < len(unpaced) / 2, (len(paced_outputs), len(unpaced))
