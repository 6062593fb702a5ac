"""Wire contract of the model repository: tensor names, and parsing of raw inputs into requests.

Pure Python: the Triton adapters read tensors into plain values (bytes, bools, lists) and call
these functions, so every validation rule is testable without a server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ddtree.config import EngineConfig
from ddtree.errors import InvalidRequest
from ddtree.sampling_params import SamplingParams, sampling_params_from_dict

# Ensemble contract (Triton vllm_backend compatible) + DDTree extras.
TEXT_INPUT = "text_input"
MESSAGES = "messages"                       # optional: chat messages JSON; the chat template is applied
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                "return_acceptance_stats")
TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
MEAN_ACCEPTANCE_LENGTH = "mean_acceptance_length"
NUM_ROUNDS = "num_rounds"

# Between the composing models.
INPUT_IDS = "input_ids"
OUTPUT_IDS = "output_ids"          # window: prefix_length context ids, then new ids
PREFIX_LENGTH = "prefix_length"
TEXT_START = "text_start"          # the response's text: characters [text_start, text_end) of the window's new text
TEXT_END = "text_end"
PROMPT_TEXT = "prompt_text"        # prepended to the text when the input is echoed
REQUEST_KEY = "request_key"        # names a running request; a stop request carries it back
STOP_REQUEST_KEY = "stop_request_key"

MAX_REQUEST_BYTES = 1 << 20


@dataclass(slots=True)
class GenerateRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echo_text: str | None              # prompt text to put before the output, if echoed
    return_flags: dict[str, bool]
    text_output: bool = False          # its responses carry text_output (the prompt came as text: no ensemble around)


def utf8(name: str, raw: bytes | str | None) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if len(raw) > MAX_REQUEST_BYTES:
        raise InvalidRequest(f"{name} is {len(raw)} bytes; the limit is {MAX_REQUEST_BYTES}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{name} is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r})") from None


def parse_json(name: str, raw: bytes | str | None, kind: type) -> Any:
    text = utf8(name, raw)
    if text is None or text.strip() == "":
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{name} is not valid JSON: {e.msg} at position {e.pos}") from None
    except (RecursionError, ValueError) as e:   # nesting deeper than the recursion limit; 4300+ digit integers
        raise InvalidRequest(f"{name} is not acceptable JSON: {str(e)[:200]}") from None
    if not isinstance(value, kind):
        raise InvalidRequest(f"{name} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def parse_messages(raw: bytes | str | None) -> list[dict[str, str]] | None:
    messages = parse_json(MESSAGES, raw, list)
    if messages is None:
        return None
    if not messages:
        raise InvalidRequest("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with string 'role' and 'content'")
    return messages


@dataclass(slots=True)
class Prompt:
    text: str | None
    messages: list[dict[str, str]] | None
    chat_template_kwargs: dict[str, Any]


def parse_prompt(text_input: bytes | str | None, messages: bytes | str | None = None,
                 chat_template_kwargs: bytes | str | None = None) -> Prompt:
    """Preprocessing inputs -> Prompt; either chat messages or a raw non-empty text."""
    parsed = parse_messages(messages)
    kwargs = parse_json(CHAT_TEMPLATE_KWARGS, chat_template_kwargs, dict) or {}
    text = utf8(TEXT_INPUT, text_input)
    if parsed is None and not text:
        raise InvalidRequest("text_input is empty (send a prompt, or chat messages in 'messages')")
    return Prompt(text=text, messages=parsed, chat_template_kwargs=kwargs)


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    if prompt.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("this model's tokenizer has no chat template; send text_input instead")
        try:
            ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                **prompt.chat_template_kwargs)
        except Exception as e:  # template errors are the client's (bad roles, kwargs)
            raise InvalidRequest(f"chat template failed: {e}") from None
    else:
        ids = tokenizer.encode(prompt.text, add_special_tokens=True)
    if not ids:
        raise InvalidRequest("prompt is empty after tokenization")
    return list(ids)


def parse_generate(inputs: dict[str, Any], config: EngineConfig, tokenizer=None) -> GenerateRequest:
    """Generation-model inputs (plain values) -> GenerateRequest; raises InvalidRequest.

    With input_ids (the ensemble's preprocessing made them) its responses carry the ids and the character range that
    the postprocessing step turns into text. Without, and with a `tokenizer`, the prompt is text_input or messages as
    the preprocessing step reads them, tokenized here, and its responses carry text_output: the vLLM backend's
    contract served by the generation model alone, two Python-backend hops a request and one a response fewer."""
    prompt_ids = inputs.get(INPUT_IDS)
    text_output = prompt_ids is None and tokenizer is not None
    if not text_output and (prompt_ids is None or len(prompt_ids) == 0):
        raise InvalidRequest("input_ids is empty")
    sampling = parse_json(SAMPLING_PARAMETERS, inputs.get(SAMPLING_PARAMETERS), dict) or {}
    params = sampling_params_from_dict(sampling, config)
    stream = bool(inputs.get(STREAM, False))
    exclude = inputs.get(EXCLUDE_INPUT_IN_OUTPUT)
    exclude = stream if exclude is None else bool(exclude)
    if stream and not exclude:
        raise InvalidRequest("exclude_input_in_output=false is not allowed when streaming")
    echo = None if exclude else (utf8(TEXT_INPUT, inputs.get(TEXT_INPUT)) or "")
    flags = {name: bool(inputs.get(name, False)) for name in RETURN_FLAGS}
    if text_output:   # after the cheap checks: a request they refuse is not tokenized
        prompt = parse_prompt(inputs.get(TEXT_INPUT), inputs.get(MESSAGES), inputs.get(CHAT_TEMPLATE_KWARGS))
        prompt_ids = encode_prompt(tokenizer, prompt)
    return GenerateRequest(prompt_ids=[int(t) for t in prompt_ids], params=params, stream=stream,
                           echo_text=echo, return_flags=flags, text_output=text_output)
