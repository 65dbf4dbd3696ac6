"""postprocessing on hand-made engine steps (no Triton, no engine)."""
import json
import math

import numpy as np

from a3b_backend.serving.llm import Step, request_arrays, step_arrays
from a3b_backend.serving.postprocess import step_outputs
from a3b_backend.serving.triton import CancellationForwarder, PollSchedule, QuietStreamWatch


def step(tokenizer, context, new, finish="", stop_reason="", echo="", stop=()):
    config = {"echo": echo, "stop": list(stop), "include_stop_str_in_output": False, "skip_special_tokens": True,
              "returns": {"return_finish_reason": True, "return_num_input_tokens": True, "return_log_probs": True}}
    return {
        "token_ids": np.asarray(new, np.int32), "context_ids": np.asarray(context, np.int32),
        "finish_reason": np.array([finish.encode()], object), "stop_reason": np.array([stop_reason.encode()], object),
        "cumulative_logprob": np.array([-1.5], np.float32), "token_logprobs": np.array([-0.5] * len(new), np.float32),
        "logprobs": np.array([b""], object), "num_input_tokens": np.array([7], np.uint32),
        "num_output_tokens": np.array([len(context) + len(new)], np.uint32),
        "postprocess_config": np.array([json.dumps(config).encode()], object),
        "reasoning_text": np.array([b""], object), "content_text": np.array([b""], object),
        "tool_calls": np.array([b""], object),
    }


def test_echo_only_on_final_and_fields_pass_through(tokenizer):
    ids = tokenizer.encode(" Paris.", add_special_tokens=False)
    out = step_outputs(step(tokenizer, [], ids, finish="stop", echo="Capital:"), tokenizer)
    assert out["text_output"][0].decode() == "Capital: Paris."
    assert out["finish_reason"][0] == b"stop"
    assert out["num_input_tokens"].dtype == np.uint32 and out["num_input_tokens"][0] == 7
    assert out["output_log_probs"].tolist() == [-0.5] * len(ids)
    assert "num_output_tokens" not in out and "logprobs" not in out


def test_final_step_cuts_the_stop_string(tokenizer):
    ids = tokenizer.encode("yes END", add_special_tokens=False)
    out = step_outputs(step(tokenizer, ids[:1], ids[1:], finish="stop", stop_reason="END", stop=("END",)), tokenizer)
    assert out["text_output"][0].decode() == " "


def test_steps_as_a3b_llm_sends_them(tokenizer):
    """a3b_llm leaves out the optional step tensors that hold nothing; postprocessing reads what is sent."""
    ids = tokenizer.encode(" Paris is big.", add_special_tokens=False)
    per_request = request_arrays(json.dumps({"returns": {"return_cumulative_logprob": True}}), "r1")
    pieces = []
    for k in range(len(ids)):
        final = k == len(ids) - 1
        arrays = step_arrays(Step(ids[k:k + 1], ids[max(0, k - 8):k], "length" if final else "", "", math.nan,
                                  [], "", 3, 1), per_request)
        assert ("context_ids" in arrays) == (k > 0) and ("finish_reason" in arrays) == final
        assert not {"stop_reason", "cumulative_logprob", "token_logprobs", "logprobs", "content_text"} & set(arrays)
        out = step_outputs(arrays, tokenizer)
        assert np.isnan(out["cumulative_logprob"][0])
        pieces.append(out["text_output"][0].decode())
    assert "".join(pieces) == " Paris is big."


def test_cancellation_is_polled_at_most_every_poll_s_per_stream():
    polls = PollSchedule(poll_s=0.1, remembered=2)
    assert polls.due("a", 10.0) and not polls.due("a", 10.05) and polls.due("a", 10.11)
    assert polls.due("b", 10.05)
    assert polls.due("c", 10.06)  # remembers two streams: "a" is forgotten, so due again
    assert polls.due("a", 10.07)


class _Request:
    """Counts how often the forwarder asks Triton whether it was cancelled."""

    def __init__(self):
        self.asked = 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return False


def test_cancellation_is_asked_only_for_identified_streams_when_due():
    forwarder, request = CancellationForwarder(pb_utils=None), _Request()
    forwarder.check(request, {})  # no request_id: nothing to abort
    assert request.asked == 0
    ids = {"request_id": np.array([b"r1"], object)}
    forwarder.check(request, ids)
    forwarder.check(request, ids)  # within the poll interval
    assert request.asked == 1


def test_a_quiet_stream_is_asked_about_cancellation_and_aborted_once():
    """No output for poll_s (a long prefill): Triton is asked; once cancelled, one abort and the watch ends."""
    import asyncio

    answers, aborted = iter([False, True]), []

    async def abort():
        aborted.append(True)

    watch = QuietStreamWatch(lambda: next(answers), abort, poll_s=0.01)
    asyncio.run(asyncio.wait_for(watch.run(), timeout=5))
    assert aborted == [True]


def test_a_stream_that_keeps_sending_is_not_asked_by_the_watch():
    import asyncio

    request = _Request()

    async def stream():
        watch = QuietStreamWatch(request.is_cancelled, lambda: asyncio.sleep(0), poll_s=0.05)
        task = asyncio.ensure_future(watch.run())
        for _ in range(20):  # an output every 10 ms for 0.2 s
            watch.output()
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(stream())
    assert request.asked == 0
