"""Stream a chat completion from the DDTree ensemble over gRPC and print tokens as they arrive.

    python client/chat.py "What is speculative decoding?" --mode ddtree --budget 32
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient


def string_tensor(name: str, value: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
    return tensor


def bool_tensor(name: str, value: bool) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def build_inputs(messages: list[dict], sampling: dict, stream: bool = True,
                 chat_template_kwargs: dict | None = None) -> list[grpcclient.InferInput]:
    inputs = [string_tensor("text_input", ""), string_tensor("messages", json.dumps(messages)),
              string_tensor("sampling_parameters", json.dumps(sampling)), bool_tensor("stream", stream),
              bool_tensor("exclude_input_in_output", True)]
    if chat_template_kwargs:
        inputs.append(string_tensor("chat_template_kwargs", json.dumps(chat_template_kwargs)))
    for flag in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                 "return_acceptance_stats"):
        inputs.append(bool_tensor(flag, True))
    return inputs


def parse_response(result) -> tuple[str, dict, bool]:
    """(text delta, outputs dict, is it the final response) of one streamed response."""
    params = result.get_response().parameters
    is_final = bool(params.get("triton_final_response") and params["triton_final_response"].bool_param)
    outputs = {}
    for output in result.get_response().outputs:
        array = result.as_numpy(output.name)
        outputs[output.name] = array.tolist() if array is not None else None
    return b"".join(outputs.get("text_output") or []).decode("utf-8"), outputs, is_final


def stream_chat(url: str, model: str, inputs: list, timeout_s: float = 600.0):
    """Yield (text_delta, outputs dict) per streamed response, over a connection of its own; raises on a server
    error; an abandoned generator, a timeout or an error cancels the request instead of waiting for it."""
    chat = ChatStream(url, timeout_s)
    try:
        yield from chat.request(model, inputs)
    finally:
        chat.close()


class ChatStream:
    """One connection and one gRPC stream for many requests, one after another (as each perf_analyzer worker keeps
    its own): no connection or stream set-up per request. `request()` yields what stream_chat yields; a request
    abandoned before its final response, timed out or ended by an error has the stream cancelled (the next request
    opens a new one)."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.timeout_s = timeout_s
        self.num_requests = 0
        self.responses: queue.Queue | None = None   # the open stream's responses (None: no stream open)

    def _open(self) -> queue.Queue:
        # a queue per stream: late callbacks of a cancelled stream land in its own
        responses = self.responses = queue.Queue()
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        return responses

    def request(self, model: str, inputs: list):
        responses = self.responses or self._open()
        self.num_requests += 1
        request_id = f"chat-{self.num_requests}"
        finished = False
        try:
            self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=self.timeout_s)
                if error is not None:
                    raise RuntimeError(str(error))
                if result.get_response().id != request_id:
                    continue
                text, outputs, is_final = parse_response(result)
                yield text, outputs
                if is_final:
                    finished = True
                    return
        finally:
            if not finished:
                self.client.stop_stream(cancel_requests=True)
                self.responses = None

    def close(self) -> None:
        if self.responses is not None:
            self.client.stop_stream()
            self.responses = None
        self.client.close()

    def __enter__(self) -> "ChatStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--system", default=None)
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--mode", choices=["ar", "dflash", "ddtree"], default=None)
    parser.add_argument("--budget", type=int, default=None)
    args = parser.parse_args()
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    for key, value in (("seed", args.seed), ("mode", args.mode), ("tree_budget", args.budget)):
        if value is not None:
            sampling[key] = value
    start, first, outputs = time.perf_counter(), None, {}
    for text, outputs in stream_chat(args.url, args.model, build_inputs(messages, sampling)):
        if text and first is None:
            first = time.perf_counter() - start
        sys.stdout.write(text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    stats = {k: (v[0] if isinstance(v, list) and v else v) for k, v in outputs.items() if k != "text_output"}
    print(f"\n--- {elapsed:.2f} s, first text after {first or 0:.2f} s, final: {stats}", file=sys.stderr)


if __name__ == "__main__":
    main()
