"""OpenAI-compatible HTTP frontend for the DDTree ensemble (standard library HTTP server + tritonclient gRPC).

    python -m openai_frontend --triton-url localhost:8001 --model ensemble --port 9000

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions,
GET /health. One thread per connection; each generation is one gRPC stream to tritonserver, cancelled
when the HTTP client goes away. The request mapping is protocol.py; the contract is README.md.
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import tritonclient.grpc as grpcclient

from openai_frontend.protocol import (
    EnsembleRequest,
    OpenAIError,
    Totals,
    chunk,
    full_response,
    parse_request,
    sse,
)
from openai_frontend.triton import EnsembleStream

MAX_BODY_BYTES = 4 << 20
POLL_S = 0.2     # how often a waiting request checks that its HTTP client is still there


class ClientGone(Exception):
    """The HTTP client closed its connection."""


@dataclass
class Settings:
    triton_url: str = "localhost:8001"
    model: str = "ensemble"                  # the Triton model requests go to
    served_model_name: str | None = None     # the name clients use (default: model)
    default_temperature: float = 1.0         # OpenAI's default when a request has no temperature
    response_timeout_s: float = 600.0        # longest wait for the next response of a running request

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class Frontend(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256   # listen backlog (socketserver's default of 5 refuses bursts of clients)

    def __init__(self, address: tuple[str, int], settings: Settings) -> None:
        super().__init__(address, Handler)
        self.settings = settings
        self.created = int(time.time())

    def triton_ready(self) -> tuple[bool, str]:
        try:
            client = grpcclient.InferenceServerClient(self.settings.triton_url)
            try:
                if not client.is_server_ready(client_timeout=5):
                    return False, "the inference server is not ready"
                if not client.is_model_ready(self.settings.model, client_timeout=5):
                    return False, f"model {self.settings.model!r} is not ready"
                return True, ""
            finally:
                client.close()
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            return False, f"the inference server at {self.settings.triton_url} is not reachable: {e}"

    def model_card(self) -> dict[str, Any]:
        return {"id": self.settings.name, "object": "model", "created": self.created, "owned_by": "ddtree"}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ddtree-openai/1"
    server: Frontend
    _last_check = 0.0   # when next_response last looked for a disconnect

    # ---- routing ----
    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [self.server.model_card()]})
            elif path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                if name != self.server.settings.name:
                    raise OpenAIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
                self.send_json(200, self.server.model_card())
            elif path in ("/health", "/v1/health"):
                ready, why = self.server.triton_ready()
                if not ready:
                    raise OpenAIError(503, why, code="unavailable")
                self.send_json(200, {"status": "ok"})
            elif path in ("/v1/chat/completions", "/v1/completions"):
                raise OpenAIError(405, f"{path} takes POST", code="method_not_allowed")
            else:
                raise OpenAIError(404, f"no route {path}", code="not_found")
        except OpenAIError as e:
            self.send_json(e.status, e.body())

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path)
        try:
            body = self.read_json()
            if kind is None:
                raise OpenAIError(404 if not path.startswith("/v1/models") else 405, f"no POST route {path}",
                                  code="not_found")
            settings = self.server.settings
            request = parse_request(kind, body, {settings.name}, settings.default_temperature)
            self.generate(request)
        except OpenAIError as e:
            self.send_json(e.status, e.body())
        except ClientGone:
            self.close_connection = True

    # ---- HTTP helpers ----
    def read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length is None:
            self.close_connection = True
            raise OpenAIError(411, "send the request body with a Content-Length", code="length_required")
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            raise OpenAIError(400, f"bad Content-Length {length!r}") from None
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            raise OpenAIError(413, f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}",
                              code="request_too_large")
        raw = self.rfile.read(size)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def start_events(self) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
        except OSError:
            raise ClientGone() from None

    def write_event(self, data: bytes) -> None:
        """One chunk of the chunked SSE body; ClientGone when the client has left."""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except OSError:   # BrokenPipeError, ConnectionResetError ...
            raise ClientGone() from None

    def client_gone(self) -> bool:
        """True when the client closed the connection (it sends nothing while it waits for our answer)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        sys.stderr.write(f"[openai_frontend] {self.address_string()} {format % args}\n")

    # ---- generation ----
    def next_response(self, stream: EnsembleStream) -> dict[str, Any]:
        """The next response; checks every POLL_S that the client is still there (it may leave at any time)."""
        now = time.monotonic()
        deadline = now + self.server.settings.response_timeout_s
        while True:
            if now - self._last_check >= POLL_S:
                self._last_check = now
                if self.client_gone():
                    raise ClientGone()
            outputs = stream.next(POLL_S)
            if outputs is not None:
                return outputs
            now = time.monotonic()
            if now > deadline:
                raise OpenAIError(504, f"no response from the inference server for "
                                       f"{self.server.settings.response_timeout_s:.0f} s", code="timeout")

    def generate(self, req: EnsembleRequest) -> None:
        stream = EnsembleStream(self.server.settings.triton_url, self.server.settings.model, req.inputs,
                                req.request_id)
        cancel = True
        try:
            outputs = self.next_response(stream)   # errors until here get their own HTTP status
            totals = Totals()
            if not req.stream:
                while True:
                    totals.add(outputs)
                    if outputs["final"]:
                        break
                    outputs = self.next_response(stream)
                cancel = False
                self.send_json(200, full_response(req, totals))
                return
            self.start_events()
            if req.kind == "chat":
                self.write_event(sse(chunk(req, text="", role=True)))
            elif req.echo_text:
                self.write_event(sse(chunk(req, text=req.echo_text)))
            try:
                while True:
                    delta = totals.add(outputs)
                    if delta:
                        self.write_event(sse(chunk(req, text=delta)))
                    if outputs["final"]:
                        break
                    outputs = self.next_response(stream)
            except OpenAIError as e:   # the status line is sent: the error goes in the stream (as vLLM does)
                self.write_event(sse(e.body()))
                self.write_event(sse("[DONE]"))
                self.write_event(b"")
                return
            cancel = False
            self.write_event(sse(chunk(req, finish_reason=totals.finish_reason or "stop",
                                       extra={"ddtree": totals.ddtree()})))
            if req.include_usage:
                self.write_event(sse(chunk(req, usage=totals.usage(), no_choices=True)))
            self.write_event(sse("[DONE]"))
            self.write_event(b"")   # end of the chunked body
        except ClientGone:
            self.close_connection = True
            raise
        finally:
            stream.close(cancel=cancel)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__.splitlines()[0])
    parser.add_argument("--triton-url", default="localhost:8001", help="tritonserver gRPC address (host:port)")
    parser.add_argument("--model", default="ensemble", help="the Triton model requests go to")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--default-temperature", type=float, default=1.0,
                        help="temperature of requests that send none (OpenAI's default is 1.0)")
    parser.add_argument("--response-timeout", type=float, default=600.0,
                        help="seconds to wait for the next response of a running request")
    parser.add_argument("--wait-ready", type=float, default=0.0,
                        help="wait up to this many seconds for the Triton model to be ready before listening")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = Settings(triton_url=args.triton_url, model=args.model, served_model_name=args.served_model_name,
                        default_temperature=args.default_temperature, response_timeout_s=args.response_timeout)
    server = Frontend((args.host, args.port), settings)
    deadline = time.monotonic() + args.wait_ready
    while True:
        ready, why = server.triton_ready()
        if ready or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if not ready:
        print(f"[openai_frontend] warning: {why}; serving anyway (requests get 503 until it is ready)",
              file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    host, port = server.server_address[:2]
    print(f"[openai_frontend] serving {settings.name!r} (Triton model {settings.model!r} at {settings.triton_url}) "
          f"on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
