#!/usr/bin/env python3
"""Chat/completion client for the a3b-triton `ensemble`: prints text as it streams.

    python client/a3b_chat.py "What is the capital of France?"
    python client/a3b_chat.py --protocol http --no-chat --max-tokens 64 "Once upon a time"

Exits 0 on success, 2 when the server refuses the request (the message says
why), 3 when the server cannot be reached.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.error
import urllib.request

import numpy as np

EXIT_REFUSED, EXIT_UNREACHABLE = 2, 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--url", help="host:port (default localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    p.add_argument("--no-stream", action="store_true", help="one response at the end instead of streaming")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each response")
    return p.parse_args(argv)


def sampling_parameters(args: argparse.Namespace) -> dict:
    chosen = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, "stop": args.stop}
    return {k: v for k, v in chosen.items() if v is not None}


def request_fields(args: argparse.Namespace) -> dict:
    return {
        "text_input": args.prompt,
        "stream": not args.no_stream,
        "apply_chat_template": not args.no_chat,
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "sampling_parameters": json.dumps(sampling_parameters(args)),
    }


def run_grpc(args: argparse.Namespace) -> str:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    client = grpcclient.InferenceServerClient(args.url or "localhost:8001")
    try:
        client.is_server_live()
    except InferenceServerException as exc:
        raise ConnectionError(str(exc)) from None
    inputs = []
    for name, value in request_fields(args).items():
        arr = np.array([value], dtype=bool) if isinstance(value, bool) else np.array([value.encode()], dtype=object)
        inp = grpcclient.InferInput(name, [1], np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    finish = ""
    try:
        client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=args.timeout)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if any(o.name == "text_output" for o in response.outputs):
                print(result.as_numpy("text_output").reshape(-1)[0].decode("utf-8"), end="", flush=True)
                finish = result.as_numpy("finish_reason").reshape(-1)[0].decode() or finish
            if response.parameters["triton_final_response"].bool_param:
                return finish
    finally:
        client.stop_stream()
        client.close()


def run_http(args: argparse.Namespace) -> str:
    fields = request_fields(args)
    path = "generate" if args.no_stream else "generate_stream"
    url = f"http://{args.url or 'localhost:8000'}/v2/models/{args.model}/{path}"
    req = urllib.request.Request(url, data=json.dumps(fields).encode(), headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=args.timeout)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(json.loads(exc.read() or b"{}").get("error", str(exc))) from None
    except urllib.error.URLError as exc:
        raise ConnectionError(str(exc.reason)) from None
    finish = ""
    with resp:
        lines = resp if not args.no_stream else [b"data: " + resp.read()]
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise RuntimeError(event["error"])
            print(event.get("text_output", ""), end="", flush=True)
            finish = event.get("finish_reason") or finish
    return finish


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        finish = (run_grpc if args.protocol == "grpc" else run_http)(args)
    except ConnectionError as exc:
        print(f"\nerror: cannot reach the server ({exc}); is `make serve` running?", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (RuntimeError, queue.Empty) as exc:
        print(f"\nerror: request refused: {exc or 'no response in time'}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"\n[finish_reason: {finish}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
