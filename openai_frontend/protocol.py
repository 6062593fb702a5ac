"""OpenAI request -> ensemble inputs, ensemble outputs -> OpenAI responses; pure Python, no I/O.

The mapping is the declared contract of this frontend (openai_frontend/README.md, "Contract").
Type checks of the OpenAI fields happen here; value ranges that depend on the deployment
(max_tokens limit, tree_budget limit, prompt length, top_p > 0, ...) are checked by the ensemble,
whose INVALID_ARG errors the server turns into HTTP 400.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# Request fields, by endpoint. Anything else is refused (OpenAI: "Unrecognized request argument").
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "metadata", "store",
                 "service_tier"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "functions", "function_call", "response_format",
                               "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
# DDTree / vLLM extensions (top-level keys, as the openai client's extra_body sends them) -> sampling_parameters.
EXTENSIONS = {"ddtree_mode": "mode", "tree_budget": "tree_budget", "top_k": "top_k", "min_tokens": "min_tokens",
              "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids"}
# Accepted only at a value that means "off" (the engine has no such feature).
NOOP_VALUES = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "logprobs": (False, 0),
               "top_logprobs": (0,), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
               "function_call": ("none", "auto"), "suffix": ("",), "best_of": (1,)}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}   # no effect on generation


class OpenAIError(Exception):
    """An error answered as OpenAI's {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@dataclass(slots=True)
class EnsembleRequest:
    """What is sent to the ensemble: inputs (name -> str | bool) and how to answer."""

    kind: str                                 # "chat" | "completion"
    model: str                                # the name the client asked for
    inputs: dict[str, str | bool]
    stream: bool                              # the client's stream flag (the ensemble always streams)
    include_usage: bool = False               # stream_options.include_usage
    echo_text: str = ""                       # completions echo: the prompt, put before the output
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_noop(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is None:
        return
    allowed = NOOP_VALUES[name]
    if value not in allowed:
        raise invalid(f"{name}={json.dumps(value)[:80]} is not supported by this server (accepted: "
                      f"{', '.join(json.dumps(a) for a in allowed)} or null)", param=name, code="unsupported_parameter")


def _message_content(i: int, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid(f"messages[{i}] must be an object", param=f"messages[{i}]")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise invalid(f"messages[{i}].role must be a non-empty string", param=f"messages[{i}].role")
    if message.get("tool_calls") or message.get("function_call"):
        raise invalid(f"messages[{i}]: tool calls are not supported by this server", param=f"messages[{i}]",
                      code="unsupported_parameter")
    if isinstance(content, list):   # content parts: text only, joined with "\n" (as vLLM does)
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}]: only parts of type 'text' are supported",
                              param=f"messages[{i}].content")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise invalid(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")
    return {"role": role, "content": content}


def parse_request(kind: str, body: Any, served_models: set[str], default_temperature: float = 1.0) -> EnsembleRequest:
    """Validate an OpenAI request body and build the ensemble's inputs; raises OpenAIError."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for key in body:
        if key not in allowed and key not in EXTENSIONS:
            raise invalid(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (a string)", param="model")
    if model not in served_models:
        raise OpenAIError(404, f"The model '{model}' does not exist (served: {', '.join(sorted(served_models))})",
                          param="model", code="model_not_found")
    if body.get("n") not in (None, 1):
        raise invalid(f"n={json.dumps(body['n'])[:40]} is not supported: this server returns one choice per request "
                      "(n must be 1)", param="n", code="unsupported_parameter")
    for name in NOOP_VALUES:
        if name in allowed:
            _check_noop(body, name)
    if kind == "chat" and body.get("response_format") not in (None, {"type": "text"}):
        raise invalid("response_format: only {\"type\": \"text\"} is supported", param="response_format",
                      code="unsupported_parameter")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream must be a boolean", param="stream")
    stream = bool(stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options must be an object with 'include_usage'", param="stream_options")
        include_usage = bool(options.get("include_usage"))

    sampling: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") if kind == "chat" else None
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise invalid(f"{name} must be an integer, got {json.dumps(max_tokens)[:40]}", param=name)
        sampling["max_tokens"] = max_tokens
    temperature = body.get("temperature")
    temperature = default_temperature if temperature is None else temperature
    if not _is_number(temperature) or not 0 <= temperature <= 2:
        raise invalid(f"temperature must be a number in [0, 2], got {json.dumps(temperature)[:40]}", param="temperature")
    sampling["temperature"] = temperature
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 <= top_p <= 1:
            raise invalid(f"top_p must be a number in [0, 1], got {json.dumps(top_p)[:40]}", param="top_p")
        sampling["top_p"] = top_p
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise invalid(f"seed must be an integer, got {json.dumps(seed)[:40]}", param="seed")
        sampling["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise invalid("stop must be a string or a list of strings", param="stop")
        if stop != []:
            sampling["stop"] = stop
    for key, target in EXTENSIONS.items():
        if body.get(key) is not None:
            sampling[target] = body[key]

    inputs: dict[str, str | bool] = {"stream": True, "exclude_input_in_output": True,
                                     "return_finish_reason": True, "return_num_input_tokens": True,
                                     "return_num_output_tokens": True, "return_acceptance_stats": True}
    echo_text = ""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("messages must be a non-empty list", param="messages")
        inputs["text_input"] = ""
        inputs["messages"] = json.dumps([_message_content(i, m) for i, m in enumerate(messages)], ensure_ascii=False)
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None:
            if not isinstance(kwargs, dict):
                raise invalid("chat_template_kwargs must be an object", param="chat_template_kwargs")
            inputs["chat_template_kwargs"] = json.dumps(kwargs, ensure_ascii=False)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise invalid("prompt must be a string (or a list of one string): token-id prompts and batches of "
                          "prompts are not supported", param="prompt", code="unsupported_parameter")
        inputs["text_input"] = prompt
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise invalid("echo must be a boolean", param="echo")
        echo_text = prompt if echo else ""
    inputs["sampling_parameters"] = json.dumps(sampling, ensure_ascii=False)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return EnsembleRequest(kind=kind, model=model, inputs=inputs, stream=stream, include_usage=include_usage,
                           echo_text=echo_text, request_id=prefix + uuid.uuid4().hex)


# ---- Responses -------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Totals:
    """What the ensemble's responses add up to."""

    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    mean_acceptance_length: float | None = None
    num_rounds: int | None = None

    def add(self, outputs: dict[str, Any]) -> str:
        """Fold one ensemble response in; returns its text delta."""
        delta = outputs.get("text_output") or ""
        self.text.append(delta)
        if outputs.get("num_input_tokens") is not None:
            self.prompt_tokens = int(outputs["num_input_tokens"])
        self.completion_tokens += int(outputs.get("num_output_tokens") or 0)
        if outputs.get("finish_reason"):
            self.finish_reason = outputs["finish_reason"]
        if outputs.get("mean_acceptance_length") is not None:
            self.mean_acceptance_length = float(outputs["mean_acceptance_length"])
        if outputs.get("num_rounds") is not None:
            self.num_rounds = int(outputs["num_rounds"])
        return delta

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def ddtree(self) -> dict[str, Any]:
        return {"mean_acceptance_length": self.mean_acceptance_length, "num_rounds": self.num_rounds}


def full_response(req: EnsembleRequest, totals: Totals) -> dict[str, Any]:
    text = req.echo_text + "".join(totals.text)
    finish = totals.finish_reason or "stop"
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": [choice],
            "usage": totals.usage(), "system_fingerprint": None, "ddtree": totals.ddtree()}


def chunk(req: EnsembleRequest, text: str | None = None, finish_reason: str | None = None, role: bool = False,
          usage: dict[str, int] | None = None, extra: dict[str, Any] | None = None,
          no_choices: bool = False) -> dict[str, Any]:
    """One SSE event body: chat.completion.chunk or text_completion."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "choices": [] if no_choices else [choice], "system_fingerprint": None}
    if req.include_usage:
        body["usage"] = usage
    if extra:
        body.update(extra)
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")


# ---- Errors from the ensemble ----------------------------------------------------------------------------

# Triton's gRPC stream carries an error's message but not its code (tritonclient raises
# InferenceServerException(msg=error_message) with no status), so the code is recovered from the
# messages that ddtree/serving.py and the models send; every other error of the ensemble is INVALID_ARG.
_UNAVAILABLE_MARKERS = ("server overloaded", "model unavailable", "retry later", "not ready", "unavailable")
_INTERNAL_MARKERS = ("engine error:", "internal error", "stub process", "exited unexpectedly")


def error_from_triton(message: str) -> OpenAIError:
    message = re.sub(r"^in ensemble '[^']*', ", "", message)   # Triton's prefix for a composing model's error
    lowered = message.lower()
    if any(m in lowered for m in _UNAVAILABLE_MARKERS):
        return OpenAIError(503, message, code="overloaded" if "overloaded" in lowered else "unavailable")
    if "request cancelled" in lowered or "cancelled" == lowered.strip():
        return OpenAIError(500, message, code="cancelled")
    if any(m in lowered for m in _INTERNAL_MARKERS):
        return OpenAIError(500, message, code="internal_error")
    return OpenAIError(400, message, code="invalid_argument")
