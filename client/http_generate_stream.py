"""Stream from the ensemble over HTTP `generate_stream` (server-sent events).

Plain HTTP `/infer` refuses decoupled models; `generate_stream` is Triton's streaming HTTP route.

    python client/http_generate_stream.py "Write a haiku about trees." --url http://localhost:8000
"""

from __future__ import annotations

import argparse
import json
import sys

import requests


def generate_stream(url: str, model: str, payload: dict, timeout_s: float = 600.0):
    """Yield the JSON object of each event; raises on an error event (HTTP status stays 200)."""
    with requests.post(f"{url}/v2/models/{model}/generate_stream", json=payload, stream=True,
                       timeout=timeout_s) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            yield event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--mode", default=None)
    args = parser.parse_args()
    sampling = {"max_tokens": args.max_tokens, "temperature": 0}
    if args.mode:
        sampling["mode"] = args.mode
    payload = {"text_input": "", "messages": json.dumps([{"role": "user", "content": args.prompt}]),
               "stream": True, "sampling_parameters": json.dumps(sampling), "return_finish_reason": True}
    for event in generate_stream(args.url, args.model, payload):
        sys.stdout.write(event.get("text_output", ""))
        sys.stdout.flush()
        if event.get("finish_reason"):
            print(f"\n--- finish_reason: {event['finish_reason']}", file=sys.stderr)


if __name__ == "__main__":
    main()
