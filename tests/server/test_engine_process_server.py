"""engine_process in a real tritonserver. true (the default on CUDA): the generation model's engine runs in a child
process of its stub (ddtree.engine_process), and the stub never loads torch; served greedy ids equal the in-process
engine's, the ensemble's streamed text equals them decoded, a client's cancellation reaches the child, and a killed
child fails its stream and every later request at once while the server goes on serving. false (the default on the
CPU): the engine on a thread of the stub serves the same ids."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from client.chat import build_inputs, stream_chat
from ddtree.config import EngineConfig
from ddtree.detokenize import decode
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams
from tests.server.conftest import DEFAULT_DRAFTER, DEFAULT_TARGET, TritonServer, set_parameter
from tests.server.test_e2e import generate_ids_direct
from tests.server.test_health import (
    CHAT,
    LONG,
    OneStream,
    children,
    ddtree_stub,
    direct_inputs,
    gauge,
    http_status,
    make_repository,
    new_requests,
    server_alive,
)

MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def engine_children(stub: int) -> list[int]:
    """Processes whose parent is the stub and whose command line runs ddtree.engine_process."""
    return [pid for pid, argv in children(stub) if b"ddtree.engine_process" in argv]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-process")
    repo = make_repository(tmp)
    set_parameter(repo / "ddtree" / "config.pbtxt", "engine_process", "true")
    with TritonServer(str(repo), log_path=str(tmp / "server.log"), exit_timeout_s=5) as running:
        yield running


def serve_greedy_ids_and_text(server) -> None:
    """Each mode's served greedy ids == the in-process engine's, and the ensemble's streamed text == them decoded."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    engine = Engine(EngineConfig(target_path=str(DEFAULT_TARGET), drafter_path=str(DEFAULT_DRAFTER)))
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    for mode in ("ar", "dflash", "ddtree"):
        sampling = {"max_tokens": 32, "temperature": 0, "mode": mode, "tree_budget": 16}
        local = engine.generate_ids(prompt_ids, SamplingParams(max_tokens=32, mode=mode, tree_budget=16)).output_ids
        assert generate_ids_direct(server, prompt_ids, sampling) == local, mode
        pieces = [text for text, _ in stream_chat(server.grpc_url, "ensemble", build_inputs(MESSAGES, sampling))]
        assert len(pieces) > 2 and "".join(pieces) == decode(tokenizer, local), mode


def test_on_a_thread_of_the_stub_the_same_ids(tmp_path):
    repo = make_repository(tmp_path)
    set_parameter(repo / "ddtree" / "config.pbtxt", "engine_process", "false")
    with TritonServer(str(repo), log_path=str(tmp_path / "server.log"), exit_timeout_s=5) as server:
        stub = ddtree_stub(server)
        assert engine_children(stub) == [] and loads_torch(stub)
        serve_greedy_ids_and_text(server)


def loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_engine_runs_in_a_child_of_the_stub(server):
    stub = ddtree_stub(server)
    children = engine_children(stub)
    assert len(children) == 1, children
    # the stub relays without importing the engine: torch is loaded by the child alone (after requests too)
    serve_greedy_ids_and_text(server)
    assert loads_torch(children[0]) and not loads_torch(stub)
    log = Path(server.log_path).read_text(errors="replace")
    assert f"engine process {children[0]} started" in log
    assert f"engine process {children[0]} serving" in log   # the child's own log records reach the server's log


def test_a_cancelled_ensemble_stream_stops_in_the_child(server):
    before = gauge(server, "ddtree_requests_cancelled_total")
    stream = OneStream(server.grpc_url, "ensemble", build_inputs(CHAT, LONG), "cancel-through-child")
    stream.wait_responses(2)
    stream.close(cancel=True)
    deadline = time.monotonic() + 30   # 1000 tokens would take minutes: only the relayed stop ends it this soon
    while time.monotonic() < deadline and (gauge(server, "ddtree_active_requests")
                                           or gauge(server, "ddtree_requests_cancelled_total") <= before):
        time.sleep(0.2)
    assert gauge(server, "ddtree_requests_cancelled_total") == before + 1
    assert gauge(server, "ddtree_active_requests") == gauge(server, "ddtree_held_cache_slots") == 0


def test_a_killed_engine_process_fails_its_stream_and_later_requests(server):
    """Last in the module: it kills the child."""
    stub = ddtree_stub(server)
    (child,) = engine_children(stub)
    stream = OneStream(server.grpc_url, "ddtree", direct_inputs(), "inflight-at-child-kill")
    stream.wait_responses(2)
    os.kill(child, signal.SIGKILL)
    outcome, message, _ = stream.wait_end(30)
    stream.close()
    assert outcome == "error" and "engine process" in message and "exited" in message, (outcome, message)
    after = new_requests(server, "after-child-kill")
    for what, outcome, message, seconds in after:
        assert outcome == "error" and "model unavailable" in message, (what, message)
        assert seconds < 5, (what, seconds)
    assert gauge(server, "ddtree_engine_healthy") == 0
    assert gauge(server, "ddtree_active_requests") == gauge(server, "ddtree_held_cache_slots") == 0
    assert server_alive(server) and os.path.exists(f"/proc/{stub}")   # the stub and the server live on
    assert http_status(server, "/v2/health/live") == 200
