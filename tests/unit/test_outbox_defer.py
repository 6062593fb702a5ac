"""The outbox's deferred hand-over and responses built on the outbox (a gated service's defaults; DDTREE_OUTBOX_WAKE=put
and DDTREE_OUTBOX_TEXT=0 turn them off): the engine thread's calls reach the outbox thread only when the gate opens
(one wake-up a round), and a request without stop strings has its text made there; the streams are the same, and a
response that cannot be built ends its stream with an error whichever thread built it."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ddtree import api, cancellation, serving
from ddtree.detokenize import decode
from ddtree.sampling_params import SamplingParams
from ddtree.serving import DeviceWaitGate, GenerationService, Outbox
from tests.unit.test_outbox_gate import wait_for
from tests.unit.test_stop_strings import MAX_TOKENS, PROMPT, engine, pick_stop, serve, tokenizer  # noqa: F401

SERVICE_ENV = {"DDTREE_OUTBOX_GATE": "1", "DDTREE_INLINE_SENDS": "0"}


def set_env(monkeypatch, env: dict[str, str]) -> None:
    """A gated service (as on CUDA) with `env` on top of the defaults."""
    for key in ("DDTREE_OUTBOX_WAKE", "DDTREE_OUTBOX_TEXT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**SERVICE_ENV, **env}.items():
        monkeypatch.setenv(key, value)


def deferring_outbox() -> tuple[Outbox, DeviceWaitGate]:
    gate = DeviceWaitGate()
    outbox = Outbox(gate=gate, defer=True)
    outbox.owner = threading.get_ident()
    gate.on_open = outbox.flush
    return outbox, gate


def test_deferred_calls_go_when_the_gate_opens(monkeypatch):
    monkeypatch.setattr(serving, "GATE_WAIT_S", 0.01)
    outbox, gate = deferring_outbox()
    done: list[int] = []
    outbox.put(done.append, 1)
    outbox.put(done.append, 2)
    time.sleep(0.2)
    assert done == [], "a deferred call ran before the gate opened (held GATE_WAIT_S at most when queued at once)"
    gate.set()
    assert wait_for(lambda: done == [1, 2])
    gate.clear()
    other = threading.Thread(target=outbox.put, args=(done.append, 3))   # another thread's call is not deferred
    other.start()
    other.join()
    assert wait_for(lambda: done == [1, 2, 3])
    outbox.put(done.append, 4)
    outbox.close(5.0)                                                     # closing hands over what is held
    assert done == [1, 2, 3, 4]


def test_deferred_calls_go_late_when_no_device_wait_comes(monkeypatch):
    monkeypatch.setattr(serving, "GATE_WAIT_S", 0.05)
    outbox, _ = deferring_outbox()
    done: list[int] = []
    outbox.put(done.append, 1)
    outbox.flush_late()
    time.sleep(0.1)
    assert done == []
    outbox.flush_late()          # the loop's check once it has waited GATE_WAIT_S: handed over, then the gate's wait
    assert wait_for(lambda: done == [1])
    outbox.close(5.0)


def serve_all(service, tokenizer, cases: dict) -> dict:  # noqa: F811 (tokenizer: the fixture's name)
    """cases: name -> (sampling, stream), each served on a thread of its own at once; their sinks, then the service
    shut down."""
    results = {}
    try:
        threads = [threading.Thread(target=lambda name=name, case=case: results.__setitem__(
            name, serve(service, tokenizer, *case))) for name, case in cases.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        service.shutdown()
    return results


def test_service_builds_text_on_the_outbox_and_streams_the_same(engine, tokenizer, monkeypatch):  # noqa: F811
    """Several requests at once, each mode, streamed and not, one with a stop string (its text stays on the engine
    thread: its end waits on it): every text is the request's free-running greedy text."""
    set_env(monkeypatch, {})   # the defaults where gated (a CUDA engine's)
    built_on: dict[str, set[str]] = {}
    add = serving._Stream.add

    def recording_add(stream, output, *args):
        built_on.setdefault(output.request_id, set()).add(threading.current_thread().name)
        return add(stream, output, *args)

    monkeypatch.setattr(serving._Stream, "add", recording_add)
    cases = {f"{mode}-{stream}": ({"max_tokens": MAX_TOKENS, "ignore_eos": True, "mode": mode, "tree_budget": 8}, stream)
             for mode in ("ar", "dflash", "ddtree") for stream in (True, False)}
    free = {mode: engine.generate_ids(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, mode=mode,
                                                             tree_budget=8)).output_ids
            for mode in ("ar", "dflash", "ddtree")}
    stop = pick_stop(tokenizer, free["ddtree"])
    cases["stop"] = ({"max_tokens": MAX_TOKENS, "ignore_eos": True, "mode": "ddtree", "tree_budget": 8, "stop": stop},
                     True)
    service = GenerationService(engine, tokenizer, max_queue_size=8)   # after the free runs: one thread steps the engine
    assert service._outbox.defer and engine.wait_gate is service._outbox.gate
    results = serve_all(service, tokenizer, cases)
    for name, (sampling, stream) in cases.items():
        sink = results[name]
        text = decode(tokenizer, free[sampling["mode"]])
        expected = text[: text.find(stop)] if name == "stop" else text
        assert "".join(sink.texts) == expected, name
        assert sink.outputs[-1][api.FINISH_REASON] == ("stop" if name == "stop" else "length"), name
        assert sum(o[api.NUM_OUTPUT_TOKENS] for o in sink.outputs) <= MAX_TOKENS
        assert (len(sink.texts) > 2) is stream, name
    # the stop-string request's text on the engine thread, every other one's on the outbox
    assert sorted(sorted(names) for names in built_on.values()) == [["ddtree-engine"]] + [["ddtree-outbox"]] * 6
    assert service.stats.num_responses == sum(len(sink.outputs) for sink in results.values())


@pytest.mark.parametrize("on_outbox", [False, True])
def test_a_response_that_cannot_be_built_ends_its_stream_with_an_error(engine, tokenizer, monkeypatch,  # noqa: F811
                                                                     on_outbox):
    set_env(monkeypatch, {} if on_outbox else {"DDTREE_OUTBOX_TEXT": "0"})
    add = serving._Stream.add
    calls = [0]

    def failing_add(stream, output, *args):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("simulated")
        return add(stream, output, *args)

    monkeypatch.setattr(serving._Stream, "add", failing_add)
    service = GenerationService(engine, tokenizer, max_queue_size=4)
    sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "mode": "ddtree", "tree_budget": 8}
    try:
        broken = serve(service, tokenizer, sampling, True)
        assert "could not build a response: ValueError: simulated" in broken.outputs[-1]["error"]
        assert wait_for(lambda: not engine.has_work), "the request was not dropped"
        whole = serve(service, tokenizer, sampling, False)   # the service goes on serving
    finally:
        service.shutdown()
    assert whole.outputs[-1][api.FINISH_REASON] == "length" and len(whole.texts) == 1
    assert service.stats.num_failed == 1 and service.stats.num_finished == 1


@pytest.mark.parametrize("env, defer, text", [
    ({}, True, True),
    ({"DDTREE_OUTBOX_WAKE": "put"}, False, True),
    ({"DDTREE_OUTBOX_TEXT": "0"}, True, False),
    ({"DDTREE_OUTBOX_GATE": "0"}, False, False),                              # a CPU engine's default: no gate
    ({"DDTREE_OUTBOX_GATE": "0", "DDTREE_OUTBOX_TEXT": "1"}, False, True),
])
def test_the_settings(engine, tokenizer, monkeypatch, env, defer, text):  # noqa: F811
    set_env(monkeypatch, env)
    service = GenerationService(engine, tokenizer, max_queue_size=4)
    try:
        assert service._outbox.defer is defer and service._text_on_outbox is text
        assert (engine.wait_gate is not None) is (env.get("DDTREE_OUTBOX_GATE") != "0")
    finally:
        service.shutdown()
        engine.wait_gate = None


@pytest.mark.parametrize("gated", [False, True])
def test_the_service_counts_its_sending_time(engine, tokenizer, monkeypatch, gated):  # noqa: F811
    """ServiceStats.send_seconds / cancel_check_seconds / num_cancel_checks: the outbox's time in the sinks (not the
    engine thread's ask as a request starts); the snapshot published once the engine is idle has them, and every
    response, sent after the engine thread took it (gated: the text too is built on the outbox)."""
    set_env(monkeypatch, {} if gated else {"DDTREE_OUTBOX_GATE": "0"})
    asked = []

    class SlowSink:
        def __init__(self):
            self.done, self.sent = threading.Event(), 0

        def is_cancelled(self):
            asked.append(threading.current_thread().name)
            time.sleep(0.002)
            return False

        def send(self, outputs, final):
            time.sleep(0.005)
            self.sent += 1
            if final:
                self.done.set()

        def send_error(self, message, kind, final=True):
            self.done.set()

    published = []
    service = GenerationService(engine, tokenizer, on_stats=published.append, max_queue_size=4)
    try:
        sink = SlowSink()
        inputs = {api.INPUT_IDS: PROMPT, api.SAMPLING_PARAMETERS: json.dumps(
            {"max_tokens": MAX_TOKENS, "ignore_eos": True, "mode": "ar"}).encode(), api.STREAM: True}
        service.submit("slow", api.parse_generate(inputs, engine.config), sink)
        assert sink.done.wait(120)
        assert wait_for(lambda: published[-1].num_finished == 1 and published[-1].num_responses == sink.sent)
    finally:
        service.shutdown()
    last, on_outbox = published[-1], [name for name in asked if name != "ddtree-engine"]
    assert asked.count("ddtree-engine") == 1   # the ask as the request starts, not counted
    assert sink.sent > 2 and 0.005 * sink.sent <= last.send_seconds < 0.005 * sink.sent + 2.0
    assert last.num_cancel_checks == len(on_outbox) and last.cancel_check_seconds >= 0.002 * len(on_outbox)


@pytest.mark.parametrize("gated", [False, True])
def test_the_service_asks_about_cancellation_at_most_so_often_in_all(engine, tokenizer, monkeypatch, gated):  # noqa: F811
    """Two streams asked at most CANCEL_ASKS_PER_S times a second in all (here 10) beside the ask as each starts; every
    CANCEL_CHECK_S (20 ms) each would be ~100 a second."""
    set_env(monkeypatch, {} if gated else {"DDTREE_OUTBOX_GATE": "0"})
    monkeypatch.setattr(cancellation, "CANCEL_ASKS_PER_S", 10.0)
    asked = []

    class SlowSink:   # each response 5 ms: the requests last long enough to be asked many times at the old pace
        def __init__(self):
            self.done = threading.Event()

        def is_cancelled(self):
            asked.append(time.monotonic())
            return False

        def send(self, outputs, final):
            time.sleep(0.005)
            if final:
                self.done.set()

        def send_error(self, message, kind, final=True):
            self.done.set()

    service = GenerationService(engine, tokenizer, max_queue_size=4)
    sinks = [SlowSink(), SlowSink()]
    try:
        start = time.monotonic()
        for i, sink in enumerate(sinks):
            inputs = {api.INPUT_IDS: PROMPT, api.SAMPLING_PARAMETERS: json.dumps(
                {"max_tokens": 100, "ignore_eos": True, "mode": "ar"}).encode(), api.STREAM: True}
            service.submit(f"asked-{i}", api.parse_generate(inputs, engine.config), sink)
        assert all(sink.done.wait(120) for sink in sinks)
        seconds = time.monotonic() - start
    finally:
        service.shutdown()
    assert seconds > 0.4, seconds   # 2 x 100 responses of 5 ms on one outbox thread
    assert len(asked) <= 2 + 10.0 * seconds + 2, (len(asked), seconds)
