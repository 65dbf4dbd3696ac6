"""Smallest useful tritonclient example: one streamed chat answer from `ensemble` over gRPC."""
import json
import queue

import numpy as np
import tritonclient.grpc as grpcclient


def infer_input(name, value):
    arr = np.array([value], dtype=bool) if isinstance(value, bool) else np.array([value.encode()], dtype=object)
    tensor = grpcclient.InferInput(name, [1], "BOOL" if arr.dtype == bool else "BYTES")
    tensor.set_data_from_numpy(arr)
    return tensor


responses = queue.Queue()
client = grpcclient.InferenceServerClient("localhost:8001")
client.start_stream(callback=lambda result, error: responses.put((result, error)))
client.async_stream_infer("ensemble", [
    infer_input("text_input", "What is the capital of France?"),
    infer_input("apply_chat_template", True),
    infer_input("stream", True),
    infer_input("sampling_parameters", json.dumps({"temperature": 0, "max_tokens": 64})),
], enable_empty_final_response=True)
while True:
    result, error = responses.get(timeout=300)
    if error:
        raise SystemExit(f"request failed: {error}")
    if any(o.name == "text_output" for o in result.get_response().outputs):
        print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
    if result.get_response().parameters["triton_final_response"].bool_param:
        break
client.stop_stream()
print()
