"""Fuzzed bad requests against a real tritonserver: each gets exactly one clear error, and the server keeps serving.

Over 1,000 malformed requests, built from a seeded generator (reproducible: FUZZ_SEED), go to the ensemble and to
the ``ddtree`` model directly over gRPC streams (raw ModelStreamInfer, so that every response, errors included,
carries its request id) and to the ensemble over HTTP ``generate`` / ``generate_stream``: wrong datatypes, shapes
and ranks, missing, empty and unknown inputs, prompts over max_model_len, inputs over the 1 MiB limit, invalid and
wrongly typed JSON, invalid UTF-8, out-of-range and unknown sampling parameters, out-of-vocabulary token ids. Every
request must end with exactly one error response (nothing accepted, nothing duplicated, nothing hung) whose message
names the problem and is not a backend crash; meanwhile and afterwards a greedy request streams the same text as
before the fuzz, and nothing stays held in the engine.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2_grpc
from tritonclient.grpc._utils import _get_inference_request

from client.chat import build_inputs, stream_chat
from tests.server.conftest import DEFAULT_TARGET, MAX_MODEL_LEN, MAX_TOKENS_LIMIT, metric

FUZZ_SEED = 20261130
NUM_CASES = 1100
NUM_GRPC_STREAMS = 4       # one request in flight per stream: the engine queue (max_queue_size 6) never overflows
NUM_HTTP_CLIENTS = 2
REQUEST_TIMEOUT_S = 60.0
MAX_TREE_BUDGET = 64   # conftest's max_tree_budget
VOCAB_SIZE = json.loads((DEFAULT_TARGET / "config.json").read_text())["vocab_size"]
MAX_REQUEST_BYTES = 1 << 20

GOOD_CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GOOD_SAMPLING = {"max_tokens": 24, "temperature": 0, "mode": "ddtree", "tree_budget": 8}

# A message with one of these is a crash leaking out of a model, not a validation error.
CRASH_MARKERS = ("Traceback", "At:\n", "Failed to process the request(s)", "Error:", "Exception", "Stub process",
                 "internal", "engine error", "overloaded")

STRING_INPUTS_ENSEMBLE = ("text_input", "messages", "chat_template_kwargs", "sampling_parameters")
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens", "return_acceptance_stats")
STRING_INPUTS_DDTREE = ("text_input", "sampling_parameters")
WRONG_DTYPES = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "FP64": np.float64, "UINT8": np.uint8,
                "INT8": np.int8, "FP16": np.float16, "BOOL": bool, "BYTES": np.object_}


@dataclass
class Case:
    id: str
    category: str
    target: str                    # grpc:ensemble | grpc:ddtree | http:generate | http:generate_stream
    inputs: list = field(default_factory=list)   # grpc: [(name, array, datatype)]; http: the body (bytes)
    expect: tuple[str, ...] = ()   # the error message contains one of these


# -- case builders -----------------------------------------------------------------------------------------------

def s(value: str | bytes) -> np.ndarray:
    return np.array([value.encode("utf-8") if isinstance(value, str) else value], dtype=np.object_)


def b(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def random_text(rng: random.Random, n: int) -> str:
    alphabet = "abcdefghij klmnopqrstuvwxyz,.!?\u00e9\u4e2d\u6587\U0001f338"
    return "".join(rng.choice(alphabet) for _ in range(n))


def ensemble_base(rng: random.Random) -> dict[str, tuple[np.ndarray, str]]:
    """A valid ensemble request (a few tokens), as name -> (array, datatype); cases break one thing."""
    inputs = {"sampling_parameters": (s(json.dumps({"max_tokens": rng.randint(1, 4)})), "BYTES"),
              "stream": (b(rng.random() < 0.5), "BOOL")}
    if rng.random() < 0.5:
        inputs["text_input"] = (s(random_text(rng, rng.randint(1, 40))), "BYTES")
    else:
        inputs["text_input"] = (s(""), "BYTES")
        inputs["messages"] = (s(json.dumps([{"role": "user", "content": random_text(rng, rng.randint(1, 40))}])),
                              "BYTES")
    if inputs["stream"][0][0] or rng.random() < 0.5:
        inputs["exclude_input_in_output"] = (b(True), "BOOL")
    return inputs


def ddtree_base(rng: random.Random) -> dict[str, tuple[np.ndarray, str]]:
    ids = np.array([rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 30))], dtype=np.int32)
    return {"input_ids": (ids, "INT32"), "stream": (b(rng.random() < 0.5), "BOOL"),
            "sampling_parameters": (s(json.dumps({"max_tokens": rng.randint(1, 4)})), "BYTES")}


def bad_sampling(rng: random.Random) -> tuple[str, bytes, tuple[str, ...]]:
    """(category, sampling_parameters bytes, expected message parts): one bad parameter among good ones."""
    good = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.5, 1.0]), "top_p": 0.9, "seed": 7,
            "mode": rng.choice(["ar", "dflash", "ddtree", "auto"]), "tree_budget": rng.randint(1, 64)}
    keep = dict(rng.sample(sorted(good.items()), rng.randint(0, len(good))))
    kind = rng.choice(["temperature", "top_p", "top_k", "max_tokens", "tree_budget", "min_tokens", "seed", "mode",
                       "unknown", "stop_many", "stop_long", "stop_type", "stop_token_ids", "ignore_eos", "noop",
                       "nonfinite", "bool_number", "string_number"])
    key, value, expect = kind, None, None
    if kind == "temperature":
        value = rng.choice([-rng.uniform(1e-6, 10), -1, rng.uniform(100.001, 1e6)])
    elif kind == "top_p":
        value = rng.choice([0, -0.5, 1.0001, rng.uniform(1.01, 100), 0.0])
    elif kind == "top_k":
        value = rng.randint(-10**6, -2)
    elif kind == "max_tokens":
        value = rng.choice([0, -1, -rng.randint(2, 10**9), MAX_TOKENS_LIMIT + 1, rng.randint(MAX_TOKENS_LIMIT + 2, 10**12),
                            10**30, 2.5, "12abc", "", [5], {"n": 5}, None])
    elif kind == "tree_budget":
        key = rng.choice(["tree_budget", "budget"])
        value = rng.choice([0, -rng.randint(1, 1000), MAX_TREE_BUDGET + 1, rng.randint(65, 10**9), "many", 3.7])
    elif kind == "min_tokens":
        key, value = "min_tokens", rng.choice([-1, MAX_TOKENS_LIMIT + 1])
        if rng.random() < 0.5:   # within its own range but above max_tokens
            keep["max_tokens"], value = 3, rng.randint(4, MAX_TOKENS_LIMIT)
            expect = ("min_tokens",)
    elif kind == "seed":
        value = rng.choice([-1, -rng.randint(2, 10**6), 2**63, 2**64 + 5, "seed", 1.5])
    elif kind == "mode":
        key = rng.choice(["mode", "decoding_mode"])
        value = rng.choice(["beam", "AR", "tree", "", "ddtree ", random_text(rng, 6), 3, None, ["ar"]])
    elif kind == "unknown":
        key = rng.choice(["max_new_tokens", "temp", "topp", "budgets", "foo", "", "MODE", "use_beam_search",
                          random_text(rng, 8)])
        value = rng.choice([1, "x", None, True, [1]])
        expect = ("unknown key",)
    elif kind == "stop_many":
        key, value = "stop", [random_text(rng, 3) + str(i) for i in range(rng.randint(17, 60))]
        expect = ("at most 16",)
    elif kind == "stop_long":
        key, value = "stop", rng.choice([[random_text(rng, rng.randint(257, 2000))], ["ok", ""], ""])
        expect = ("sampling_parameters.stop strings must have",)
    elif kind == "stop_type":
        key, value = "stop", rng.choice([5, [1, 2], {"a": "b"}, ["ok", None], True])
    elif kind == "stop_token_ids":
        value = rng.choice([5, "2", [1.5], ["1"], [True], {"a": 1}, [[1]]])
    elif kind == "ignore_eos":
        value = rng.choice(["maybe", 2, [True], {"x": 1}, "yes"])
    elif kind == "noop":
        key, value = rng.choice([("n", 2), ("best_of", 3), ("presence_penalty", 0.5), ("frequency_penalty", -1),
                                 ("repetition_penalty", 1.3), ("logprobs", 5), ("skip_special_tokens", False)])
        expect = ("is not supported",)
    elif kind == "nonfinite":
        key = rng.choice(["temperature", "top_p"])
        raw = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", '"nan"', '"inf"'])
        keep.pop(key, None)
        body = json.dumps(keep)[:-1] + (", " if keep else "") + f'"{key}": {raw}}}'
        return "param_range", body.encode(), (f"sampling_parameters.{key}",)
    elif kind == "bool_number":
        key, value = rng.choice(["max_tokens", "temperature", "top_p", "tree_budget", "top_k"]), rng.choice([True, False])
    elif kind == "string_number":
        key, value = rng.choice(["max_tokens", "tree_budget", "top_k", "seed"]), rng.choice(["1.5", "ten", "0x10", " "])
    keep.pop(key, None)
    keep[key] = value
    items = list(keep.items())
    rng.shuffle(items)
    return "param_range", json.dumps(dict(items)).encode(), expect or (f"sampling_parameters.{key}",)


def invalid_json(rng: random.Random, kind: type) -> bytes:
    good = json.dumps({"max_tokens": 3} if kind is dict else [{"role": "user", "content": "hi"}])
    return rng.choice([good[:-1], good[:rng.randint(1, len(good) - 1)], good + ",", good.replace('"', "'"),
                       "{max_tokens: 3}", "[{role: user}]", "{\"a\": }", "nan nan", "{" * 3, "}", "<xml/>",
                       good + good, "{\"a\": 1,}", "[1, 2,]", "\"unterminated"]).encode()


def wrong_json_type(rng: random.Random, name: str) -> tuple[bytes, tuple[str, ...]]:
    if name == "sampling_parameters":
        value = rng.choice([[1, 2], 3, "text", True, [{"max_tokens": 3}], 1.5])
        return json.dumps(value).encode(), ("sampling_parameters must be a JSON dict",)
    if name == "chat_template_kwargs":
        value = rng.choice([[1], 3, "enable_thinking", True, [["a", 1]]])
        return json.dumps(value).encode(), ("chat_template_kwargs must be a JSON dict",)
    choice = rng.randrange(4)
    if choice == 0:
        return json.dumps(rng.choice([{"role": "user", "content": "hi"}, 3, "hi", True])).encode(), \
            ("messages must be a JSON list",)
    if choice == 1:
        return b"[]", ("messages must not be empty",)
    bad = rng.choice([{"role": 1, "content": "hi"}, {"role": "user"}, {"content": "hi"}, "hi", 5, None, [],
                      {"role": "user", "content": ["a"]}, {"role": None, "content": None},
                      {"role": "user", "content": {"type": "text", "text": "hi"}}])
    messages = [{"role": "user", "content": "ok"}] * rng.randint(0, 2) + [bad]
    return json.dumps(messages).encode(), (f"messages[{len(messages) - 1}]",)


def invalid_utf8(rng: random.Random, text: bytes) -> bytes:
    bad = rng.choice([b"\xff", b"\xfe", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xe2\x82\x28", b"\xf0\x28\x8c\xbc",
                      b"\xf8\xa1\xa1\xa1\xa1", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80"])
    at = rng.randint(0, len(text))
    return text[:at] + bad + text[at:]


def grpc_ensemble_case(rng: random.Random) -> tuple[str, dict, tuple[str, ...]]:
    inputs = ensemble_base(rng)
    kind = rng.choice(["wrong_type", "wrong_type", "wrong_shape", "wrong_shape", "missing_input", "unknown_input",
                       "huge", "invalid_json", "invalid_json", "wrong_json_type", "wrong_json_type", "invalid_utf8",
                       "invalid_utf8", "param_range", "param_range", "param_range", "param_range", "echo_stream",
                       "chat_template"])
    if kind == "wrong_type":
        name = rng.choice(STRING_INPUTS_ENSEMBLE + BOOL_INPUTS)
        expected = "BYTES" if name in STRING_INPUTS_ENSEMBLE else "BOOL"
        dtype = rng.choice([d for d in WRONG_DTYPES if d != expected])
        shape = (1,)
        if dtype == "BYTES":
            array = s(rng.choice(["true", "1", "yes"]))
        else:
            array = np.array([rng.randint(0, 1) if dtype in ("UINT8", "BOOL") else rng.uniform(-5, 5)],
                             dtype=WRONG_DTYPES[dtype]).reshape(shape)
        inputs[name] = (array, dtype)
        return kind, inputs, (f"inference input '{name}' data-type is",)
    if kind == "wrong_shape":
        name = rng.choice(STRING_INPUTS_ENSEMBLE + BOOL_INPUTS)
        shape = rng.choice([(0,), (2,), (3,), (1, 1), (2, 2), (1, 1, 1), (5,)])
        count = int(np.prod(shape))
        if name in STRING_INPUTS_ENSEMBLE:
            array = np.array([b"{}" for _ in range(count)], dtype=np.object_).reshape(shape)
            dtype = "BYTES"
        else:
            array, dtype = np.ones(shape, dtype=bool), "BOOL"
        inputs[name] = (array, dtype)
        return kind, inputs, (f"unexpected shape for input '{name}'",)
    if kind == "missing_input":   # no prompt at all: empty text_input and no messages (a missing text_input: below)
        inputs.pop("messages", None)
        inputs["text_input"] = (s(""), "BYTES")
        if rng.random() < 0.3:
            inputs["messages"] = (s(rng.choice(["", "   "])), "BYTES")
        return kind, inputs, ("text_input is empty",)
    if kind == "unknown_input":
        name = rng.choice(["input_ids", "prompt", "max_tokens", "text", "Text_Input", "stop_request_key", "temperature"])
        inputs[name] = (s("5"), "BYTES") if rng.random() < 0.5 else (np.array([5], dtype=np.int32), "INT32")
        return kind, inputs, (f"unexpected inference input '{name}'",)
    if kind == "huge":
        which = rng.randrange(4)
        if which == 0:   # over the context: the prompt alone is over max_model_len tokens
            inputs.pop("messages", None)
            inputs["text_input"] = (s(" ".join(["hello"] * rng.randint(MAX_MODEL_LEN + 10, 3 * MAX_MODEL_LEN))), "BYTES")
            return kind, inputs, ("shorter than the context",)
        if which == 1:
            inputs["text_input"] = (s(""), "BYTES")
            content = " ".join(["word"] * rng.randint(MAX_MODEL_LEN + 10, 2 * MAX_MODEL_LEN))
            inputs["messages"] = (s(json.dumps([{"role": "user", "content": content}])), "BYTES")
            return kind, inputs, ("shorter than the context",)
        if which == 2:   # over the 1 MiB input limit (never tokenized)
            name = rng.choice(["text_input", "messages", "sampling_parameters", "chat_template_kwargs"])
            inputs[name] = (s(b"a" * (MAX_REQUEST_BYTES + rng.randint(1, 200_000))), "BYTES")
            return kind, inputs, (f"{name} is ", "bytes; the limit is")
        sampling = {"max_tokens": rng.choice([MAX_TOKENS_LIMIT + 1, 10**6, 10**15, 2**31, 2**63])}
        inputs["sampling_parameters"] = (s(json.dumps(sampling)), "BYTES")
        return kind, inputs, ("sampling_parameters.max_tokens must be in",)
    if kind == "invalid_json":
        name = rng.choice(["sampling_parameters", "messages", "chat_template_kwargs"])
        inputs[name] = (s(invalid_json(rng, list if name == "messages" else dict)), "BYTES")
        return kind, inputs, (f"{name} is not valid JSON",)
    if kind == "wrong_json_type":
        name = rng.choice(["sampling_parameters", "messages", "chat_template_kwargs"])
        raw, expect = wrong_json_type(rng, name)
        inputs[name] = (s(raw), "BYTES")
        return kind, inputs, expect
    if kind == "invalid_utf8":
        name = rng.choice(["text_input", "messages", "sampling_parameters", "chat_template_kwargs"])
        current = inputs.get(name, (s(b"{}"),))[0][0]
        if name == "text_input" and not current:
            current = b"hello"
        if name == "chat_template_kwargs":
            current = b'{"enable_thinking": false}'
        inputs[name] = (s(invalid_utf8(rng, current)), "BYTES")
        return kind, inputs, (f"{name} is not valid UTF-8",)
    if kind == "param_range":
        category, raw, expect = bad_sampling(rng)
        inputs["sampling_parameters"] = (s(raw), "BYTES")
        return category, inputs, expect
    if kind == "echo_stream":
        inputs["stream"] = (b(True), "BOOL")
        inputs["exclude_input_in_output"] = (b(False), "BOOL")
        return kind, inputs, ("exclude_input_in_output=false is not allowed when streaming",)
    # chat template kwargs that the template cannot take
    inputs["text_input"] = (s(""), "BYTES")
    inputs["messages"] = (s(json.dumps([{"role": "user", "content": "hi"}])), "BYTES")
    key = rng.choice(["messages", "add_generation_prompt", "bos_token", "eos_token"])
    inputs["chat_template_kwargs"] = (s(json.dumps({key: rng.choice([False, 1, "x"])})), "BYTES")
    return "chat_template", inputs, ("chat template failed",)


def grpc_ddtree_case(rng: random.Random) -> tuple[str, dict, tuple[str, ...]]:
    inputs = ddtree_base(rng)
    kind = rng.choice(["wrong_type", "wrong_shape", "missing_input", "unknown_input", "huge", "out_of_vocab",
                       "invalid_json", "wrong_json_type", "invalid_utf8", "param_range", "param_range", "echo_stream"])
    if kind == "wrong_type":
        name = rng.choice(("input_ids",) + STRING_INPUTS_DDTREE + BOOL_INPUTS)
        expected = {"input_ids": "INT32"}.get(name, "BYTES" if name in STRING_INPUTS_DDTREE else "BOOL")
        dtype = rng.choice([d for d in WRONG_DTYPES if d != expected])
        count = rng.randint(1, 8) if name == "input_ids" else 1
        if dtype == "BYTES":
            array = np.array([b"7"] * count, dtype=np.object_)
        else:
            array = np.array([rng.randint(0, 1) for _ in range(count)], dtype=WRONG_DTYPES[dtype])
        inputs[name] = (array, dtype)
        return kind, inputs, (f"inference input '{name}' data-type is",)
    if kind == "wrong_shape":
        name = rng.choice(("input_ids",) + STRING_INPUTS_DDTREE + BOOL_INPUTS)
        if name == "input_ids":
            shape = rng.choice([(1, 4), (2, 3), (1, 1, 2), (3, 1)])
            inputs[name] = (np.ones(shape, dtype=np.int32), "INT32")
        elif name in STRING_INPUTS_DDTREE:
            shape = rng.choice([(0,), (2,), (1, 1)])
            inputs[name] = (np.array([b"{}"] * int(np.prod(shape)), dtype=np.object_).reshape(shape), "BYTES")
        else:
            shape = rng.choice([(0,), (2,), (1, 1)])
            inputs[name] = (np.ones(shape, dtype=bool), "BOOL")
        return kind, inputs, (f"unexpected shape for input '{name}'",)
    if kind == "missing_input":
        if rng.random() < 0.5:   # no ids: the prompt is read as text (the generation model alone), here none
            inputs.pop("input_ids")
            inputs.pop("text_input", None)
            return kind, inputs, ("text_input is empty",)
        inputs["input_ids"] = (np.zeros((0,), dtype=np.int32), "INT32")
        return kind, inputs, ("input_ids is empty",)
    if kind == "unknown_input":
        name = rng.choice(["prompt", "prompt_ids", "ids", "output_ids", "text_output"])
        inputs[name] = (s("x"), "BYTES")
        return kind, inputs, (f"unexpected inference input '{name}'",)
    if kind == "huge":
        if rng.random() < 0.7:
            ids = np.array([rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(MAX_MODEL_LEN, 3 * MAX_MODEL_LEN))],
                           dtype=np.int32)
            inputs["input_ids"] = (ids, "INT32")
            return kind, inputs, ("shorter than the context",)
        inputs["sampling_parameters"] = (s(json.dumps({"max_tokens": rng.randint(MAX_TOKENS_LIMIT + 1, 10**9)})), "BYTES")
        return kind, inputs, ("sampling_parameters.max_tokens must be in",)
    if kind == "out_of_vocab":
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 10))]
        bad = rng.choice([-1, -rng.randint(2, 2**31 - 1), VOCAB_SIZE, rng.randint(VOCAB_SIZE + 1, 2**31 - 1)])
        ids.insert(rng.randint(0, len(ids)), bad)
        inputs["input_ids"] = (np.array(ids, dtype=np.int32), "INT32")
        return kind, inputs, ("prompt token ids must be in",)
    if kind == "invalid_json":
        inputs["sampling_parameters"] = (s(invalid_json(rng, dict)), "BYTES")
        return kind, inputs, ("sampling_parameters is not valid JSON",)
    if kind == "wrong_json_type":
        raw, expect = wrong_json_type(rng, "sampling_parameters")
        inputs["sampling_parameters"] = (s(raw), "BYTES")
        return kind, inputs, expect
    if kind == "invalid_utf8":
        if rng.random() < 0.5:
            inputs["sampling_parameters"] = (s(invalid_utf8(rng, b'{"max_tokens": 3}')), "BYTES")
            return kind, inputs, ("sampling_parameters is not valid UTF-8",)
        inputs["stream"] = (b(False), "BOOL")   # the echoed prompt text is decoded
        inputs["exclude_input_in_output"] = (b(False), "BOOL")
        inputs["text_input"] = (s(invalid_utf8(rng, b"echo me")), "BYTES")
        return kind, inputs, ("text_input is not valid UTF-8",)
    if kind == "param_range":
        category, raw, expect = bad_sampling(rng)
        inputs["sampling_parameters"] = (s(raw), "BYTES")
        return category, inputs, expect
    inputs["stream"] = (b(True), "BOOL")
    inputs["exclude_input_in_output"] = (b(False), "BOOL")
    return "echo_stream", inputs, ("exclude_input_in_output=false is not allowed when streaming",)


def http_case(rng: random.Random) -> tuple[str, bytes, tuple[str, ...]]:
    body: dict = {"text_input": random_text(rng, rng.randint(1, 30)), "stream": rng.random() < 0.5,
                  "sampling_parameters": json.dumps({"max_tokens": rng.randint(1, 4)})}
    kind = rng.choice(["param_range", "param_range", "invalid_json", "wrong_json_type", "invalid_utf8", "huge",
                       "missing_input", "json_type", "json_shape", "bad_body"])
    if kind == "param_range":
        category, raw, expect = bad_sampling(rng)
        body["sampling_parameters"] = raw.decode()
        return category, json.dumps(body).encode(), expect
    if kind == "invalid_json":
        name = rng.choice(["sampling_parameters", "messages"])
        body[name] = invalid_json(rng, list if name == "messages" else dict).decode()
        return kind, json.dumps(body).encode(), (f"{name} is not valid JSON",)
    if kind == "wrong_json_type":
        name = rng.choice(["sampling_parameters", "messages", "chat_template_kwargs"])
        raw, expect = wrong_json_type(rng, name)
        body[name] = raw.decode()
        return kind, json.dumps(body).encode(), expect
    if kind == "invalid_utf8":   # raw invalid bytes inside the body's JSON strings
        name = rng.choice(["text_input", "sampling_parameters"])
        marker = "\u2603MARK\u2603"
        body[name] = '{"mode": "' + marker + '"}' if name == "sampling_parameters" else "say " + marker
        raw = json.dumps(body, ensure_ascii=False).encode()
        return kind, raw.replace(marker.encode(), invalid_utf8(rng, b"")), (f"{name} is not valid UTF-8",)
    if kind == "huge":
        if rng.random() < 0.5:
            body["text_input"] = " ".join(["hello"] * rng.randint(MAX_MODEL_LEN + 10, 3 * MAX_MODEL_LEN))
            return kind, json.dumps(body).encode(), ("shorter than the context",)
        body["sampling_parameters"] = json.dumps({"max_tokens": rng.randint(MAX_TOKENS_LIMIT + 1, 10**12)})
        return kind, json.dumps(body).encode(), ("sampling_parameters.max_tokens must be in",)
    if kind == "missing_input":
        body["text_input"] = ""
        return kind, json.dumps(body).encode(), ("text_input is empty",)
    if kind == "json_type":   # a JSON value of the wrong type for a tensor (Triton's own parser answers)
        name = rng.choice(["text_input", "sampling_parameters", "messages", "stream", "exclude_input_in_output"])
        if name in ("stream", "exclude_input_in_output"):
            body[name] = rng.choice(["yes", 1, None, {"a": 1}, "true"])
            return "wrong_type", json.dumps(body).encode(), ("non-boolean as boolean",)
        body[name] = rng.choice([5, 1.5, True, None, {"max_tokens": 3}])
        return "wrong_type", json.dumps(body).encode(), ("non-string as string",)
    if kind == "json_shape":
        name = rng.choice(["text_input", "sampling_parameters", "stream"])
        body[name] = [True if name == "stream" else body.get(name) or "x"] * rng.randint(2, 4)
        return "wrong_shape", json.dumps(body).encode(), (f"convert input '{name}' to tensor with proper shape",)
    raw = rng.choice([b"not json", b"", b"[1, 2]", b"{\"text_input\": ", b"\xff\xfe", b"null", b"{\"text_input\": \"a\"}}"])
    return "bad_body", raw, ("parse", "non-object", "Invalid", "JSON")


def build_cases(seed: int = FUZZ_SEED, count: int = NUM_CASES) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.55:
            category, inputs, expect = grpc_ensemble_case(rng)
            target = "grpc:ensemble"
        elif roll < 0.82:
            category, inputs, expect = grpc_ddtree_case(rng)
            target = "grpc:ddtree"
        else:
            category, inputs, expect = http_case(rng)
            target = rng.choice(["http:generate", "http:generate_stream"])
            cases.append(Case(f"fuzz-{i}", category, target, inputs, expect))
            continue
        tensors = [(name, array, dtype) for name, (array, dtype) in inputs.items()]
        rng.shuffle(tensors)
        cases.append(Case(f"fuzz-{i}", category, target, tensors, expect))
    return cases


# -- senders -----------------------------------------------------------------------------------------------------

class RawStream:
    """One gRPC ModelStreamInfer; every response (errors too) is recorded under its request id."""

    def __init__(self, url: str):
        self.channel = grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 64 << 20),
                                                           ("grpc.max_receive_message_length", 64 << 20)])
        self.requests: queue.Queue = queue.Queue()
        self.events: dict[str, list[tuple[str, bool | None]]] = {}
        self.done: dict[str, threading.Event] = {}
        self.stray: list[str] = []
        self.lock = threading.Lock()
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.responses = stub.ModelStreamInfer(iter(self.requests.get, None))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for response in self.responses:
                rid = response.infer_response.id
                params = response.infer_response.parameters
                final = params["triton_final_response"].bool_param if "triton_final_response" in params else None
                with self.lock:
                    if rid not in self.events:
                        self.stray.append(f"{rid!r}: {response.error_message[:200]!r}")
                        continue
                    self.events[rid].append((response.error_message, final))
                    if response.error_message or final:
                        self.done[rid].set()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.stray.append(f"stream ended: {e.code()} {e.details()}")

    def send(self, case: Case) -> None:
        tensors = []
        for name, array, dtype in case.inputs:
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        request = _get_inference_request(model_name=case.target.split(":")[1], inputs=tensors, model_version="",
                                         request_id=case.id, outputs=None, sequence_id=0, sequence_start=False,
                                         sequence_end=False, priority=0, timeout=None, parameters=None)
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        with self.lock:
            self.events[case.id] = []
            self.done[case.id] = threading.Event()
        self.requests.put(request)

    def close(self) -> None:
        self.requests.put(None)
        self.reader.join(30)
        self.channel.close()


def http_send(session: requests.Session, url: str, case: Case) -> list[tuple[str, bool | None]]:
    """[(error message or "", final)] for an HTTP generate / generate_stream request."""
    endpoint = case.target.split(":")[1]
    reply = session.post(f"http://{url}/v2/models/ensemble/{endpoint}", data=case.inputs,
                         headers={"Content-Type": "application/json"}, timeout=REQUEST_TIMEOUT_S)
    if endpoint == "generate" or not reply.text.startswith("data:"):
        try:
            body = reply.json()
        except ValueError:
            return [(f"not JSON (HTTP {reply.status_code}): {reply.text[:200]!r}", None)]
        return [(body.get("error", ""), True) if isinstance(body, dict) else ("", True)]
    events = []
    for line in reply.text.splitlines():
        if line.startswith("data:"):
            body = json.loads(line[5:])
            events.append((body.get("error", ""), None))
    return events


def check_message(case: Case, message: str) -> str | None:
    """None when the message is a clear error about this case's defect, else what is wrong with it."""
    if not message:
        return "accepted (a response without an error)"
    crash = [m for m in CRASH_MARKERS if m in message]
    if crash:
        return f"looks like a crash ({crash}): {message[:300]!r}"
    if not any(part in message for part in case.expect):
        return f"does not name the problem (expected one of {case.expect}): {message[:300]!r}"
    return None


def error_kind(message: str) -> str:
    for kind, marker in (("triton: datatype", "data-type is"), ("triton: shape", "unexpected shape"),
                         ("triton: shape", "tensor with proper shape"), ("triton: unknown input", "unexpected inference input"),
                         ("triton: JSON value type", "attempt to access JSON"), ("triton: request body", "parse"),
                         ("triton: request body", "non-object"), ("ddtree: not valid UTF-8", "not valid UTF-8"),
                         ("ddtree: not valid JSON", "not valid JSON"), ("ddtree: JSON type", "must be a JSON"),
                         ("ddtree: chat template", "chat template"), ("ddtree: empty prompt", "is empty"),
                         ("ddtree: messages", "messages"), ("ddtree: over the input limit", "bytes; the limit"),
                         ("ddtree: prompt over the context", "shorter than the context"),
                         ("ddtree: out-of-vocabulary ids", "prompt token ids"),
                         ("ddtree: unknown sampling key", "unknown key"), ("ddtree: stop strings", ".stop"),
                         ("ddtree: sampling parameter", "sampling_parameters."), ("ddtree: echo with stream", "exclude_input")):
        if marker in message:
            return kind
    return "other"


def greedy_text(server) -> str:
    return "".join(text for text, _ in stream_chat(server.grpc_url, "ensemble", build_inputs(GOOD_CHAT, GOOD_SAMPLING),
                                                   timeout_s=120))


# -- tests -------------------------------------------------------------------------------------------------------

def test_cases_are_reproducible_and_cover_every_kind():
    first, again = build_cases(), build_cases()
    assert [(c.id, c.category, c.target, c.expect) for c in first] == [(c.id, c.category, c.target, c.expect) for c in again]
    assert len(first) >= 1000
    targets = Counter(c.target for c in first)
    categories = Counter(c.category for c in first)
    assert set(targets) == {"grpc:ensemble", "grpc:ddtree", "http:generate", "http:generate_stream"}
    assert {"wrong_type", "wrong_shape", "missing_input", "unknown_input", "huge", "invalid_json", "wrong_json_type",
            "invalid_utf8", "param_range", "out_of_vocab", "echo_stream", "chat_template"} <= set(categories)
    assert min(targets.values()) >= 50


def test_fuzzed_bad_requests_get_one_clear_error_each_and_the_server_keeps_serving(server):
    cases = build_cases()
    before = greedy_text(server)
    assert before

    # a greedy stream runs again and again while the fuzz goes on: it must not change
    stop_background, background = threading.Event(), []

    def keep_serving():
        while not stop_background.is_set():
            background.append(greedy_text(server))

    results: dict[str, list[tuple[str, bool | None]]] = {}
    durations: dict[str, float] = {}
    hung: list[str] = []
    grpc_cases = [c for c in cases if c.target.startswith("grpc")]
    http_cases = [c for c in cases if c.target.startswith("http")]

    def grpc_worker(share: list[Case]) -> None:
        stream = RawStream(server.grpc_url)
        try:
            for case in share:
                start = time.monotonic()
                stream.send(case)
                if not stream.done[case.id].wait(REQUEST_TIMEOUT_S):
                    hung.append(case.id)
                durations[case.id] = time.monotonic() - start
            time.sleep(1.0)   # anything more for these ids would be a duplicate
        finally:
            stream.close()
        with stream.lock:
            results.update(stream.events)
            if stream.stray:
                results[f"stray-{id(stream)}"] = [(m, None) for m in stream.stray]

    def http_worker(share: list[Case]) -> None:
        with requests.Session() as session:
            for case in share:
                start = time.monotonic()
                try:
                    results[case.id] = http_send(session, server.http_url, case)
                except requests.Timeout:
                    hung.append(case.id)
                durations[case.id] = time.monotonic() - start

    start = time.monotonic()
    threads = [threading.Thread(target=keep_serving, daemon=True)]
    threads += [threading.Thread(target=grpc_worker, args=(grpc_cases[i::NUM_GRPC_STREAMS],), daemon=True)
                for i in range(NUM_GRPC_STREAMS)]
    threads += [threading.Thread(target=http_worker, args=(http_cases[i::NUM_HTTP_CLIENTS],), daemon=True)
                for i in range(NUM_HTTP_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads[1:]:
        thread.join(900)
    stop_background.set()
    threads[0].join(300)
    elapsed = time.monotonic() - start

    problems = []
    strays = [events for key, events in results.items() if key.startswith("stray-")]
    problems += [f"response for an unknown request: {m}" for events in strays for m, _ in events]
    kinds, categories = Counter(), Counter()
    for case in cases:
        events = results.get(case.id, [])
        categories[(case.target, case.category)] += 1
        if case.id in hung:
            problems.append(f"{case.id} ({case.target} {case.category}): no final response in {REQUEST_TIMEOUT_S} s")
            continue
        errors = [m for m, _ in events if m]
        if len(events) != 1 or len(errors) != 1:
            problems.append(f"{case.id} ({case.target} {case.category}): {len(events)} responses, {len(errors)} errors: "
                            f"{[(m[:120], f) for m, f in events]}")
            continue
        trouble = check_message(case, errors[0])
        if trouble:
            problems.append(f"{case.id} ({case.target} {case.category}): {trouble}")
        kinds[error_kind(errors[0])] += 1

    slowest = sorted(durations.items(), key=lambda item: -item[1])[:3]
    print(f"\nfuzz: {len(cases)} bad requests (seed {FUZZ_SEED}) in {elapsed:.1f} s, {NUM_GRPC_STREAMS} gRPC streams + "
          f"{NUM_HTTP_CLIENTS} HTTP clients; {len(background)} good greedy streams meanwhile; slowest: {slowest}")
    print("by target and category:")
    for (target, category), count in sorted(categories.items()):
        print(f"  {target:22s} {category:16s} {count:4d}")
    print("by error kind:")
    for kind, count in kinds.most_common():
        print(f"  {kind:34s} {count:4d}")
    assert not problems, f"{len(problems)} of {len(cases)} requests went wrong:\n" + "\n".join(problems[:40])

    # the server kept serving, identically
    assert background and all(text == before for text in background), "a good request changed during the fuzz"
    assert greedy_text(server) == before
    assert server.is_ready()
    for path in ("/v2/health/live", "/v2/models/ensemble/ready", "/v2/models/ddtree/ready"):
        assert urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=10).status == 200, path
    deadline = time.time() + 30
    while time.time() < deadline and (metric(server, "ddtree_active_requests") or metric(server, "ddtree_held_cache_slots")
                                      or metric(server, "ddtree_waiting_requests")):
        time.sleep(0.2)
    assert metric(server, "ddtree_active_requests") == metric(server, "ddtree_held_cache_slots") == 0
    assert metric(server, "ddtree_waiting_requests") == 0


# Bad requests this fuzz found answered without a clear error, fixed since (kept as regression cases):
# * a missing text_input: Triton 2.51 does not check an ensemble's required inputs, so text_input is
#   declared optional and preprocessing answers "text_input is empty";
# * JSON nested deeper than Python's recursion limit, or an integer of more than 4300 digits:
#   ddtree.api.parse_json turns RecursionError / ValueError into an invalid-argument error.
FORMER_DEFECTS = [
    ("missing text_input (gRPC)", "grpc", [("sampling_parameters", s('{"max_tokens": 2}'), "BYTES")], ("text_input",)),
    ("missing text_input (HTTP generate)", "http", b'{"sampling_parameters": "{}"}', ("text_input",)),
    ("deeply nested sampling_parameters", "grpc",
     [("text_input", s("hi"), "BYTES"), ("sampling_parameters", s("[" * 5000), "BYTES")], ("sampling_parameters",)),
    ("deeply nested messages", "grpc",
     [("text_input", s(""), "BYTES"), ("messages", s("[" * 5000), "BYTES")], ("messages",)),
    ("integer of 5000 digits", "grpc",
     [("text_input", s("hi"), "BYTES"), ("sampling_parameters", s('{"max_tokens": ' + "9" * 5000 + "}"), "BYTES")],
     ("sampling_parameters",)),
]


@pytest.mark.parametrize("defect", FORMER_DEFECTS, ids=[d[0] for d in FORMER_DEFECTS])
def test_former_defects_get_a_clear_error(server, defect):
    name, transport, inputs, expect = defect
    case = Case(f"defect-{name}", "defect", "grpc:ensemble" if transport == "grpc" else "http:generate", inputs, expect)
    if transport == "http":
        events = http_send(requests.Session(), server.http_url, case)
    else:
        stream = RawStream(server.grpc_url)
        stream.send(case)
        assert stream.done[case.id].wait(REQUEST_TIMEOUT_S), "no final response"
        time.sleep(0.5)
        stream.close()
        events = stream.events[case.id]
    assert len(events) == 1, events
    assert check_message(case, events[0][0]) is None, events
