"""The OpenAI-compatible frontend (openai_frontend/) in front of a real tritonserver.

The frontend runs as its own process (python -m openai_frontend) against the session's server; every
answer is checked against the ensemble's own output for the same request over gRPC.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from client.chat import bool_tensor, build_inputs, stream_chat, string_tensor
from openai_frontend.protocol import parse_request
from scripts.triton_env import free_port
from tests.server.conftest import (
    MAX_NUM_SEQS,
    MAX_QUEUE_SIZE,
    MAX_TOKENS_LIMIT,
    ROOT,
    metric,
    wait_for_cancellation,
    wait_idle,
)

CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]
CHAT_CJK = [{"role": "user", "content": "请用中文写一句关于春天的话，并加上表情符号🌸。"}]
PROMPT = "Once upon a time"


@contextmanager
def running_frontend(server, log: Path, *args: str):
    """http://127.0.0.1:PORT of a frontend process talking to the server (args: more of its options)."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "openai_frontend", "--triton-url", server.grpc_url,
                                 "--port", str(port), "--wait-ready", "60", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, "the frontend did not start: " + log.read_text()
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def frontend(server, tmp_path_factory):
    """The frontend in front of the session's tritonserver's ensemble."""
    with running_frontend(server, tmp_path_factory.mktemp("openai") / "frontend.log") as url:
        yield url


def post(url: str, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(f"{url}/v1/{path}", json=body, timeout=300, **kwargs)


def events(response: requests.Response) -> list[dict]:
    """The JSON events of an SSE response, which must end with data: [DONE]."""
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/event-stream")
    out, done = [], False
    for line in response.iter_lines(decode_unicode=False):
        if not line:
            continue
        assert line.startswith(b"data: "), line
        assert not done, "nothing may follow [DONE]"
        if line == b"data: [DONE]":
            done = True
            continue
        out.append(json.loads(line[6:]))
    assert done, "the stream must end with data: [DONE]"
    return out


def ensemble_whole(server, inputs) -> tuple[str, dict]:
    """The ensemble's own non-streamed answer over gRPC: (text, final outputs)."""
    results = list(stream_chat(server.grpc_url, "ensemble", inputs))
    return "".join(text for text, _ in results), results[-1][1]


def check_error(response: requests.Response, status: int, text: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "type" in error and "code" in error, error
    assert text is None or text in error["message"], error
    return error


# ---- the declared contract, without a server ----

def test_contract_maps_openai_fields_to_the_ensemble_inputs():
    chat = parse_request("chat", {
        "model": "ensemble", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                       {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n\n",
        "n": 1, "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0, "user": "u",
        "ddtree_mode": "ddtree", "tree_budget": 32, "top_k": 5, "min_tokens": 2, "ignore_eos": False,
        "stop_token_ids": [2], "chat_template_kwargs": {"enable_thinking": False}}, {"ensemble"})
    assert chat.inputs == {
        "text_input": "", "messages": json.dumps([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi\nthere"}]),
        "chat_template_kwargs": '{"enable_thinking": false}',
        "sampling_parameters": json.dumps({"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                           "stop": "\n\n", "mode": "ddtree", "tree_budget": 32, "top_k": 5,
                                           "min_tokens": 2, "ignore_eos": False, "stop_token_ids": [2]}),
        "stream": True, "exclude_input_in_output": True, "return_finish_reason": True,
        "return_num_input_tokens": True, "return_num_output_tokens": True, "return_acceptance_stats": True}
    assert chat.stream and chat.include_usage
    completion = parse_request("completion", {"model": "ensemble", "prompt": [PROMPT], "echo": True}, {"ensemble"})
    assert completion.inputs["text_input"] == PROMPT and completion.echo_text == PROMPT
    assert json.loads(completion.inputs["sampling_parameters"]) == {"temperature": 1.0}   # OpenAI's default
    assert completion.inputs["stream"] is True and not completion.stream      # the ensemble always streams


# ---- through the server ----

def test_models(frontend):
    listing = requests.get(f"{frontend}/v1/models", timeout=10).json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == ["ensemble"]
    assert listing["data"][0]["object"] == "model"
    assert requests.get(f"{frontend}/v1/models/ensemble", timeout=10).json()["id"] == "ensemble"
    check_error(requests.get(f"{frontend}/v1/models/nope", timeout=10), 404)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
@pytest.mark.parametrize("messages", [CHAT, CHAT_CJK], ids=["en", "cjk"])
def test_chat_whole_equals_streamed_equals_ensemble(server, frontend, mode, messages):
    sampling = {"max_tokens": 40, "temperature": 0, "mode": mode, "tree_budget": 8}
    expected, final = ensemble_whole(server, build_inputs(messages, sampling, stream=False))
    body = {"model": "ensemble", "messages": messages, "max_tokens": 40, "temperature": 0, "ddtree_mode": mode,
            "tree_budget": 8}
    whole = post(frontend, "chat/completions", body)
    assert whole.status_code == 200, whole.text
    reply = whole.json()
    assert reply["object"] == "chat.completion" and reply["model"] == "ensemble" and reply["id"].startswith("chatcmpl-")
    choice = reply["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected}
    assert choice["finish_reason"] == final["finish_reason"][0].decode()
    assert reply["usage"]["prompt_tokens"] == final["num_input_tokens"][0]
    assert reply["usage"]["completion_tokens"] == final["num_output_tokens"][0] > 0
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
    assert reply["ddtree"]["num_rounds"] >= 1

    chunks = events(post(frontend, "chat/completions", {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}, stream=True))
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:] if c["choices"]
                and "content" in c["choices"][0]["delta"]]
    assert "".join(contents) == expected
    assert len(contents) > 2, "the text should arrive in several chunks"
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == [choice["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == reply["usage"]


def test_completions(server, frontend):
    inputs = [string_tensor("text_input", PROMPT), bool_tensor("stream", False),
              bool_tensor("exclude_input_in_output", True), bool_tensor("return_finish_reason", True),
              string_tensor("sampling_parameters", json.dumps({"max_tokens": 16, "temperature": 0}))]
    expected, final = ensemble_whole(server, inputs)
    body = {"model": "ensemble", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    reply = post(frontend, "completions", body).json()
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    assert reply["choices"][0]["text"] == expected and expected
    assert reply["choices"][0]["finish_reason"] == final["finish_reason"][0].decode()
    assert reply["usage"]["completion_tokens"] <= 16
    chunks = events(post(frontend, "completions", {**body, "stream": True}, stream=True))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == reply["choices"][0]["finish_reason"]
    echoed = post(frontend, "completions", {**body, "prompt": [PROMPT], "echo": True}).json()
    assert echoed["choices"][0]["text"] == PROMPT + expected
    chunks = events(post(frontend, "completions", {**body, "echo": True, "stream": True}, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + expected


def test_seeded_sampling_is_reproducible(frontend):
    body = {"model": "ensemble", "messages": CHAT, "max_tokens": 12, "temperature": 0.9, "seed": 7}
    first, second = (post(frontend, "chat/completions", body).json() for _ in range(2))
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_stop_strings(frontend):
    body = {"model": "ensemble", "messages": CHAT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    free = post(frontend, "chat/completions", body).json()["choices"][0]["message"]["content"]
    start = next(i for i in range(len(free) // 2, len(free)) if free.find(free[i: i + 6]) == i)
    stop = free[start: start + 6]
    body["stop"] = ["\u2603\u2603", stop]
    reply = post(frontend, "chat/completions", body).json()
    assert reply["choices"][0]["message"]["content"] == free[:start], (stop, reply)
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] < 48
    chunks = events(post(frontend, "chat/completions", {**body, "stream": True}, stream=True))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == free[:start]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    single = post(frontend, "completions", {"model": "ensemble", "prompt": PROMPT, "max_tokens": 16,
                                            "temperature": 0, "stop": "\u2603"}).json()
    assert single["choices"][0]["finish_reason"] in ("stop", "length")


BAD = [
    ("n=2", {"n": 2}, 400, "n must be 1"),
    ("temperature out of range", {"temperature": 5}, 400, "temperature"),
    ("temperature not a number", {"temperature": "hot"}, 400, "temperature"),
    ("unknown model", {"model": "gpt-4o"}, 404, "does not exist"),
    ("unknown field", {"frobnicate": 1}, 400, "Unrecognized request argument"),
    ("logprobs", {"logprobs": True}, 400, "logprobs"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("max_tokens zero (ensemble)", {"max_tokens": 0}, 400, "max_tokens must be in"),
    ("max_tokens above the limit (ensemble)", {"max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "max_tokens must be in"),
    ("tree_budget too large (ensemble)", {"tree_budget": 65}, 400, "tree_budget must be in"),
    ("unknown mode (ensemble)", {"ddtree_mode": "beam"}, 400, "mode must be one of"),
    ("top_p zero (ensemble)", {"top_p": 0}, 400, "top_p"),
    ("streamed, ensemble error", {"max_tokens": 0, "stream": True}, 400, "max_tokens must be in"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request_is_an_openai_error_and_the_frontend_keeps_serving(frontend, case):
    _, fields, status, text = case
    body = {"model": "ensemble", "messages": CHAT, "max_tokens": 4, **fields}
    check_error(post(frontend, "chat/completions", body), status, text)
    ok = post(frontend, "chat/completions", {"model": "ensemble", "messages": CHAT, "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_malformed_requests(frontend):
    for raw in (b'{"model": "ensemble", "messages": [', b"\xff\xfe", b"[1, 2]"):
        reply = requests.post(f"{frontend}/v1/chat/completions", data=raw, timeout=30,
                              headers={"Content-Type": "application/json"})
        check_error(reply, 400)
    check_error(requests.post(f"{frontend}/v1/completions", json={"model": "ensemble", "prompt": [1, 2, 3]},
                              timeout=30), 400, "token-id prompts")
    check_error(requests.post(f"{frontend}/v1/completions", json={"model": "ensemble", "prompt": ""}, timeout=30),
                400, "text_input is empty")   # refused by the ensemble's preprocessing step
    check_error(requests.get(f"{frontend}/v1/nothing", timeout=30), 404)
    check_error(requests.get(f"{frontend}/v1/chat/completions", timeout=30), 405)
    assert requests.get(f"{frontend}/v1/models", timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_client_disconnect_cancels_the_request(server, frontend, stream):
    """A client that goes away mid-request: the frontend cancels the Triton stream and the engine frees it."""
    # idle first: the gauge of the request before (the last test's) may still count it, and read as this one running
    # (under contention, make test's two workers, the whole request was then dropped before Triton had it)
    assert not wait_idle(server)["ddtree_active_requests"], "the server never became idle"
    cancelled_before = metric(server, "ddtree_requests_cancelled_total")
    host, port = frontend.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": "ensemble", "messages": CHAT, "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0,
            "ignore_eos": True, "ddtree_mode": "ar", "stream": stream}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        response = conn.getresponse()
        assert response.status == 200
        seen = 0
        while seen < 4:      # the role chunk, then text: the request is running
            line = response.fp.readline()
            seen += line.startswith(b"data: ")
    else:
        deadline = time.time() + 60
        while metric(server, "ddtree_active_requests") == 0:
            assert time.time() < deadline
            time.sleep(0.1)
    conn.sock.shutdown(2)
    conn.close()
    wait_for_cancellation(server, cancelled_before)
    assert metric(server, "ddtree_active_requests") == 0, "the abandoned request still runs"
    assert metric(server, "ddtree_requests_cancelled_total") == cancelled_before + 1
    ok = post(frontend, "chat/completions", {"model": "ensemble", "messages": CHAT, "max_tokens": 4})
    assert ok.status_code == 200


def test_overload_is_503(frontend):
    """More concurrent requests than slots + queue: the excess gets 503 at once, the others complete."""
    count = MAX_NUM_SEQS + MAX_QUEUE_SIZE + 4
    body = {"model": "ensemble", "messages": CHAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "ddtree_mode": "ar"}

    def one(_):
        start = time.time()
        reply = post(frontend, "chat/completions", body)
        return reply, time.time() - start

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(one, range(count)))
    refused = [(r, t) for r, t in results if r.status_code != 200]
    served = [r for r, _ in results if r.status_code == 200]
    assert refused, "some requests should have been refused"
    for reply, seconds in refused:
        assert check_error(reply, 503, "overloaded")["code"] == "overloaded" and seconds < 10
    assert len(served) >= MAX_NUM_SEQS and all(r.json()["usage"]["completion_tokens"] == 24 for r in served)


def test_the_frontend_over_the_generation_model_alone(server, tmp_path):
    """--model ddtree: the frontend's requests go to the generation model itself (the prompt as text, no ensemble
    steps around it): the same chat completion, whole and streamed, as through the ensemble; a bad request is still an
    OpenAI error naming the problem."""
    body = {"model": "ddtree", "messages": CHAT_CJK, "max_tokens": 40, "temperature": 0, "ddtree_mode": "ddtree",
            "tree_budget": 8}
    expected, _ = ensemble_whole(server, build_inputs(CHAT_CJK, {"max_tokens": 40, "temperature": 0, "mode": "ddtree",
                                                                 "tree_budget": 8}, stream=False))
    with running_frontend(server, tmp_path / "frontend.log", "--model", "ddtree") as url:
        whole = post(url, "chat/completions", body)
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["message"]["content"] == expected and whole.json()["model"] == "ddtree"
        chunks = events(post(url, "chat/completions", {**body, "stream": True}, stream=True))
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expected
        check_error(post(url, "chat/completions", {**body, "max_tokens": MAX_TOKENS_LIMIT + 1}), 400, "max_tokens")
