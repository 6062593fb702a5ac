"""End to end through a real tritonserver: streaming exactness, HTTP, cancellation, bad input."""

from __future__ import annotations

import json
import queue
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from client.chat import bool_tensor, build_inputs, stream_chat, string_tensor
from client.http_generate_stream import generate_stream
from ddtree.config import EngineConfig
from ddtree.detokenize import decode
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams
from tests.server.conftest import DEFAULT_DRAFTER, DEFAULT_TARGET, MAX_MODEL_LEN, MAX_TOKENS_LIMIT, metric, wait_for_cancellation

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "请用中文写一句关于春天的话，并加上表情符号🌸。"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_TARGET)


def run_stream(server, messages, sampling, stream=True, model="ensemble"):
    texts, finals = [], []
    for text, outputs in stream_chat(server.grpc_url, model, build_inputs(messages, sampling, stream=stream)):
        texts.append(text)
        finals.append(outputs)
    return texts, finals[-1]


def generate_ids_direct(server, prompt_ids, sampling):
    """Ask the ddtree model itself (no ensemble) for the output ids of a non-streamed request."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    ids = grpcclient.InferInput("input_ids", [len(prompt_ids)], "INT32")
    ids.set_data_from_numpy(np.array(prompt_ids, dtype=np.int32))
    inputs = [ids, string_tensor("sampling_parameters", json.dumps(sampling)), bool_tensor("stream", False),
              bool_tensor("exclude_input_in_output", True)]
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("ddtree", inputs)
        result, error = responses.get(timeout=300)
        assert error is None, error
        assert int(result.as_numpy("prefix_length")[0]) == 0
        return result.as_numpy("output_ids").tolist()
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_streamed_equals_nonstreamed_equals_decode(server, tokenizer, mode, chat):
    messages = CHATS[chat]
    sampling = {"max_tokens": 48, "temperature": 0, "mode": mode, "tree_budget": 8}
    pieces, final = run_stream(server, messages, sampling, stream=True)
    whole, final_whole = run_stream(server, messages, sampling, stream=False)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    output_ids = generate_ids_direct(server, prompt_ids, sampling)
    streamed = "".join(pieces)
    assert len(whole) == 1
    assert streamed == whole[0] == decode(tokenizer, output_ids), f"mode {mode} chat {chat}"
    assert len(pieces) > 2, "the stream should arrive in several responses"
    assert final["finish_reason"][0] in (b"stop", b"length")
    assert sum(1 for p in pieces if "\ufffd" in p) == 0
    assert final_whole["num_input_tokens"][0] == len(prompt_ids)


def test_stop_string_ends_streamed_and_whole_text_before_it(server):
    """A stop string spanning several tokens and streamed rounds: the text ends right before it, streamed or not."""
    sampling = {"max_tokens": 48, "temperature": 0, "ignore_eos": True, "mode": "ddtree", "tree_budget": 8}
    free = stream_text(server, CHATS[2], sampling)[0]
    start = next(i for i in range(len(free) // 2, len(free)) if free.find(free[i : i + 7]) == i)   # its first occurrence
    stop, expected = free[start : start + 7], free[:start]
    sampling["stop"] = ["\u2603\u2603", stop]
    pieces, final = run_stream(server, CHATS[2], sampling)
    whole, final_whole = run_stream(server, CHATS[2], sampling, stream=False)
    assert "".join(pieces) == whole[0] == expected and len(whole) == 1, (stop, pieces, whole)
    assert len(pieces) > 2 and final["finish_reason"][0] == final_whole["finish_reason"][0] == b"stop"
    assert final_whole["num_output_tokens"][0] < 48, "the request should leave at the round that completes the stop"


def test_served_output_equals_in_process_engine(server, tokenizer):
    """Served greedy ids == the engine run in this process on the same prompt (and == ar)."""
    engine = Engine(EngineConfig(target_path=str(DEFAULT_TARGET), drafter_path=str(DEFAULT_DRAFTER)))
    prompt_ids = tokenizer.apply_chat_template(CHATS[2], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    for mode in ("ar", "dflash", "ddtree"):
        sampling = {"max_tokens": 32, "temperature": 0, "mode": mode, "tree_budget": 16}
        local = engine.generate_ids(prompt_ids, SamplingParams(max_tokens=32, mode=mode, tree_budget=16)).output_ids
        assert generate_ids_direct(server, prompt_ids, sampling) == local, mode


def test_generation_model_froze_its_heap_after_warm_up(server):
    """The served model's stub froze what loading and warm-up left (ddtree.serving.freeze_heap): logged once per
    instance, before it served, with the number of objects a full collection no longer walks."""
    found = re.findall(r"gc: (\d+) objects from loading and warm-up frozen", open(server.log_path).read())
    assert found and all(int(n) > 10_000 for n in found), found


def test_http_generate_stream_and_generate(server):
    sampling = json.dumps({"max_tokens": 40, "temperature": 0})
    payload = {"text_input": "", "messages": json.dumps(CHATS[1]), "stream": True, "sampling_parameters": sampling,
               "return_finish_reason": True, "return_num_output_tokens": True}
    events = list(generate_stream(f"http://{server.http_url}", "ensemble", payload))
    streamed = "".join(e["text_output"] if isinstance(e["text_output"], str) else "".join(e["text_output"])
                       for e in events)
    pieces, _ = run_stream(server, CHATS[1], {"max_tokens": 40, "temperature": 0})
    assert streamed == "".join(pieces)
    assert sum(e["num_output_tokens"] for e in events) <= 40
    assert events[-1]["finish_reason"] in ("stop", "length")
    # non-streaming HTTP generate: exactly one response
    payload["stream"] = False
    reply = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", json=payload, timeout=300)
    assert reply.status_code == 200, reply.text
    text = reply.json()["text_output"]
    assert (text if isinstance(text, str) else "".join(text)) == streamed


@pytest.mark.parametrize("mode", ["ar", "dflash", "ddtree"])
def test_the_generation_model_alone_serves_the_ensembles_text(server, mode):
    """The ddtree model asked with the ensemble's inputs (messages, no input_ids) tokenizes the prompt itself and
    streams text_output: response for response the ensemble's text, and the same text over HTTP's generate_stream."""
    sampling = {"max_tokens": 40, "temperature": 0, "mode": mode, "tree_budget": 8}
    ensemble, ensemble_final = run_stream(server, CHATS[1], sampling)
    alone, alone_final = run_stream(server, CHATS[1], sampling, model="ddtree")
    assert alone == ensemble and len(alone) > 2
    assert {k: alone_final[k] for k in ensemble_final} == ensemble_final
    whole, _ = run_stream(server, CHATS[1], sampling, stream=False, model="ddtree")
    assert whole == ["".join(ensemble)]
    payload = {"text_input": "", "messages": json.dumps(CHATS[1]), "stream": True, "sampling_parameters": json.dumps(sampling)}
    events = list(generate_stream(f"http://{server.http_url}", "ddtree", payload))
    assert "".join(e["text_output"] if isinstance(e["text_output"], str) else "".join(e["text_output"])
                   for e in events) == "".join(ensemble)


@pytest.mark.parametrize("model", ["ensemble", "ddtree"])
def test_raw_text_input_with_echo(server, model):
    """vLLM contract: non-streamed output echoes the prompt unless exclude_input_in_output."""
    inputs = [string_tensor("text_input", "Once upon a time"), bool_tensor("stream", False),
              string_tensor("sampling_parameters", json.dumps({"max_tokens": 8, "temperature": 0}))]
    texts = [t for t, _ in stream_chat(server.grpc_url, model, inputs)]
    assert len(texts) == 1 and texts[0].startswith("Once upon a time") and len(texts[0]) > len("Once upon a time")


@pytest.mark.parametrize("model", ["ensemble", "ddtree", "ddtree-text"])
def test_cancelled_stream_frees_its_request(server, tokenizer, model):
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    sampling = {"max_tokens": MAX_TOKENS_LIMIT, "temperature": 0, "ignore_eos": True, "mode": "ar"}
    if model in ("ensemble", "ddtree-text"):   # ddtree-text: the generation model alone, the prompt as text
        inputs, model = build_inputs(CHATS[0], sampling), model.removesuffix("-text")
    else:
        ids = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True, return_dict=False)
        tensor = grpcclient.InferInput("input_ids", [len(ids)], "INT32")
        tensor.set_data_from_numpy(np.array(ids, dtype=np.int32))
        inputs = [tensor, string_tensor("sampling_parameters", json.dumps(sampling)), bool_tensor("stream", True)]
    cancelled_before = metric(server, "ddtree_requests_cancelled_total")
    client.async_stream_infer(model, inputs)
    for _ in range(3):   # the stream is flowing
        result, error = responses.get(timeout=120)
        assert error is None, error
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_for_cancellation(server, cancelled_before)
    assert metric(server, "ddtree_active_requests") == 0, "the cancelled request still holds the engine"
    assert metric(server, "ddtree_requests_cancelled_total") == cancelled_before + 1
    assert "cancelled after" in open(server.log_path).read()
    # and the engine serves the next request right away
    pieces, final = run_stream(server, CHATS[0], {"max_tokens": 8, "temperature": 0})
    assert final["num_output_tokens"] is not None


BAD_REQUESTS = [
    ("empty prompt", dict(text=""), "text_input is empty"),
    ("prompt longer than the context", dict(text="hello " * (MAX_MODEL_LEN + 10)), "shorter than the context"),
    ("max_tokens zero", dict(sampling='{"max_tokens": 0}'), "max_tokens must be in"),
    ("max_tokens above limit", dict(sampling=json.dumps({"max_tokens": MAX_TOKENS_LIMIT + 1})), "max_tokens must be in"),
    ("malformed sampling JSON", dict(sampling='{"max_tokens": 5'), "not valid JSON"),
    ("unknown mode", dict(sampling='{"mode": "beam"}'), "mode must be one of"),
    ("budget too large", dict(sampling='{"tree_budget": 65}'), "tree_budget must be in"),
    ("budget zero", dict(sampling='{"tree_budget": 0}'), "tree_budget must be in"),
    ("invalid UTF-8 prompt", dict(raw_text=b"caf\xc3\x28 bad"), "not valid UTF-8"),
    ("invalid UTF-8 sampling", dict(raw_sampling=b'{"max_tokens": "\xff"}'), "not valid UTF-8"),
    ("bad messages", dict(messages='[{"role": 1}]'), "messages[0]"),
    ("stream with echo", dict(echo=True), "exclude_input_in_output=false is not allowed"),
    ("too many stop strings", dict(sampling=json.dumps({"stop": ["x"] * 17})), "at most 16"),
]


def raw_string(name: str, value: bytes) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value], dtype=np.object_))
    return tensor


@pytest.mark.parametrize("model", ["ensemble", "ddtree"])
@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_clear_error_and_server_keeps_serving(server, case, model):
    _, spec, expected = case
    inputs = [raw_string("text_input", spec.get("raw_text", spec.get("text", "Hi").encode()))]
    sampling = spec.get("raw_sampling", spec.get("sampling", '{"max_tokens": 4}').encode() if isinstance(
        spec.get("sampling", ""), str) else b"")
    inputs.append(raw_string("sampling_parameters", sampling))
    if "messages" in spec:
        inputs.append(string_tensor("messages", spec["messages"]))
    inputs.append(bool_tensor("stream", True))
    if spec.get("echo"):
        inputs.append(bool_tensor("exclude_input_in_output", False))
    start = time.time()
    with pytest.raises(RuntimeError) as info:
        list(stream_chat(server.grpc_url, model, inputs, timeout_s=60))
    assert expected in str(info.value), str(info.value)
    assert time.time() - start < 30
    pieces, final = run_stream(server, CHATS[0], {"max_tokens": 4, "temperature": 0})
    assert "".join(pieces) and final["finish_reason"][0] == b"length"


def stream_text(server, messages, sampling) -> tuple[str, dict]:
    pieces, final = run_stream(server, messages, sampling)
    return "".join(pieces), final


def test_concurrent_streams_equal_alone(server):
    """Requests decoded together in one engine (max_num_seqs 4, mixed modes) stream what each streams alone."""
    jobs = [(CHATS[i % len(CHATS)], {"max_tokens": 24 + 4 * i, "temperature": 0, "ignore_eos": True,
                                     "mode": ["ar", "dflash", "ddtree"][i % 3], "tree_budget": 8}) for i in range(6)]
    alone = [stream_text(server, m, s)[0] for m, s in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: stream_text(server, *job)[0], jobs))
    assert together == alone


def test_overload_is_a_quick_clear_error(server):
    """More requests than slots + queue: the excess is refused at once, the admitted ones finish intact."""
    from tests.server.conftest import MAX_NUM_SEQS, MAX_QUEUE_SIZE

    count = MAX_NUM_SEQS + MAX_QUEUE_SIZE + 6
    sampling = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "mode": "ar"}

    def one(_):
        start = time.time()
        try:
            text, final = stream_text(server, CHATS[0], sampling)
            return "ok", time.time() - start, final
        except RuntimeError as e:
            return str(e), time.time() - start, None

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(one, range(count)))
    refused = [r for r in results if r[0] != "ok"]
    served = [r for r in results if r[0] == "ok"]
    assert refused and all("overloaded" in r[0] for r in refused), [r[0] for r in refused]
    assert all(r[1] < 10 for r in refused), [r[1] for r in refused]
    assert len(served) >= MAX_NUM_SEQS
    # every admitted request streamed its 40 tokens: the final response's delta counts sum up in run_stream
    texts = {stream_text(server, CHATS[0], sampling)[0]}
    assert len(texts) == 1


def one_chaotic_request(server, i: int, rng_seed: int) -> str:
    """Finish, cancel after the first response, or drop the connection, at random.

    A refusal ("overloaded": dropped streams still hold slots until the server notices them) is retried the way a
    client backs off, so every drawn action runs; the actions drawn are fixed by the seed, whatever the timing.
    """
    import random

    rng = random.Random(rng_seed)
    action = rng.choice(["finish", "cancel", "disconnect"])
    # 4-12 tokens: several rounds a request (a cancel after the first response still lands mid-generation), short enough for 200 requests
    # through 4 slots on 2 CPU cores (6-24 took 155 s of the suite)
    sampling = {"max_tokens": rng.randint(4, 12), "temperature": rng.choice([0, 0.8]), "seed": i, "ignore_eos": True,
                "mode": rng.choice(["ar", "dflash", "ddtree"]), "tree_budget": rng.choice([4, 16])}
    deadline = time.time() + 120
    while True:
        outcome = chaotic_attempt(server, i, action, sampling)
        if outcome != "overloaded" or time.time() > deadline:
            return outcome
        time.sleep(0.2)


def chaotic_attempt(server, i: int, action: str, sampling: dict) -> str:
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("ensemble", build_inputs(CHATS[i % len(CHATS)], sampling), enable_empty_final_response=True)
    result, error = responses.get(timeout=120)
    if error is not None:
        client.stop_stream()
        client.close()
        return "overloaded" if "overloaded" in str(error) else f"error: {error}"
    if action == "cancel":
        client.stop_stream(cancel_requests=True)
        client.close()
        return "cancel"
    if action == "disconnect":
        client.close()   # no stop_stream: the channel goes away under the running stream
        return "disconnect"
    while not result.get_response().parameters["triton_final_response"].bool_param:
        result, error = responses.get(timeout=120)
        assert error is None, error
    client.stop_stream()
    client.close()
    return "finish"


def test_200_requests_with_cancellations_and_disconnects_leave_nothing_held(server):
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda i: one_chaotic_request(server, i, 1000 + i), range(200)))
    assert not [o for o in outcomes if o.startswith("error")], outcomes
    assert outcomes.count("finish") > 20 and outcomes.count("cancel") > 20 and outcomes.count("disconnect") > 20
    deadline = time.time() + 120
    while time.time() < deadline and (metric(server, "ddtree_active_requests") or metric(server, "ddtree_held_cache_slots")
                                      or metric(server, "ddtree_waiting_requests")):
        time.sleep(0.5)
    assert metric(server, "ddtree_active_requests") == 0
    assert metric(server, "ddtree_held_cache_slots") == 0
    assert metric(server, "ddtree_waiting_requests") == 0
    text, final = stream_text(server, CHATS[0], {"max_tokens": 8, "temperature": 0})
    assert text and final["finish_reason"][0] in (b"stop", b"length")


def test_one_stream_carries_many_requests(server):
    """client.chat.ChatStream: requests one after another over one open gRPC stream (as a perf_analyzer worker
    sends them) get what a connection of their own gets; an abandoned request cancels and reopens the stream, and
    the next request is answered in full."""
    from client.chat import ChatStream

    sampling = {"max_tokens": 12, "temperature": 0.0}
    alone = ["".join(run_stream(server, m, sampling)[0]) for m in CHATS]
    with ChatStream(server.grpc_url, timeout_s=120) as chat:
        shared = ["".join(t for t, _ in chat.request("ensemble", build_inputs(m, sampling))) for m in CHATS]
        assert shared == alone
        partial = chat.request("ensemble", build_inputs(CHATS[0], {"max_tokens": 200, "ignore_eos": True}))
        next(partial)
        partial.close()   # abandoned after its first response
        again = [t for t, _ in chat.request("ensemble", build_inputs(CHATS[1], sampling))]
        assert "".join(again) == alone[1]
