"""The engine in a child process (ddtree.engine_process), driven as the Triton model drives it, without a server:
the same responses as the GenerationService on a thread, cancellation and stop relayed to the child, a load failure
reported with the child's traceback, and a dead child failing its requests and refusing later ones."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
import torch

import ddtree
from ddtree import api, cancellation, engine_process
from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.engine_process import EngineProcess, child_pythonpath, find_python
from ddtree.sampling_params import SamplingParams
from ddtree.serving import GenerationService
from ddtree.tokenizer import Tokenizer
from tests.server.conftest import DEFAULT_DRAFTER, DEFAULT_TARGET

PROMPT = [1, 504, 3458, 314, 253, 1345, 30, 2]


class Sink:
    """A ResponseSink recording what it is sent; is_cancelled turns true once `cancel` is set."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.cancel = False
        self.asked = 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancel

    def send(self, outputs, final):
        self.events.put(("out", outputs, final))

    def send_error(self, message, kind, final=True):
        self.events.put((kind, message, final))

    def until_final(self, timeout_s: float = 120) -> list:
        got = []
        while not got or not got[-1][2]:
            got.append(self.events.get(timeout=timeout_s))
        return got


def config(**changes) -> EngineConfig:
    return EngineConfig(**{"target_path": str(DEFAULT_TARGET), "drafter_path": str(DEFAULT_DRAFTER), "max_num_seqs": 2,
                           "max_model_len": 512, "max_tokens_limit": 400, "max_tree_budget": 16, **changes})


def request(stream: bool, mode: str, max_tokens: int = 24, ignore_eos: bool = False) -> api.GenerateRequest:
    return api.GenerateRequest(prompt_ids=PROMPT, stream=stream, echo_text=None,
                               params=SamplingParams(max_tokens=max_tokens, mode=mode, tree_budget=8, ignore_eos=ignore_eos),
                               return_flags={name: True for name in api.RETURN_FLAGS})


def without_key(events: list) -> list:
    return [(kind, {k: v for k, v in outputs.items() if k != api.REQUEST_KEY} if kind == "out" else outputs, final)
            for kind, outputs, final in events]


@pytest.fixture(scope="module")
def child():
    stats: list = []
    process = EngineProcess(config(), tokenizer_path=str(DEFAULT_TARGET), max_queue_size=4)
    process.start(stats.append)
    process.stats = stats
    yield process
    process.shutdown()
    assert process._child.poll() is not None, "the child should have exited"


def test_a_plain_interpreter_of_this_version_is_found():
    out = os.popen(f"{find_python()} -c 'import sys; print(sys.version_info[:2])'").read().strip()
    assert out == str(tuple(__import__("sys").version_info[:2]))


def test_auto_runs_the_engine_in_a_process_where_the_device_is_cuda():
    assert engine_process.wanted(config(device="cuda")) and engine_process.wanted(config(device="cuda:1"))
    assert not engine_process.wanted(config())   # the CPU
    assert engine_process.wanted(config(engine_process=True)) and not engine_process.wanted(config(device="cuda", engine_process=False))
    assert EngineConfig.from_dict({"target_path": "t", "drafter_path": "d", "engine_process": "auto"}).engine_process is None


def test_the_childs_search_path_is_this_ones_less_the_standard_library():
    parts = child_pythonpath().split(os.pathsep)
    assert sysconfig.get_path("stdlib") not in parts and not any(p.endswith(".zip") for p in parts)
    assert str(Path(ddtree.__file__).resolve().parents[1]) in parts   # the project
    assert str(Path(torch.__file__).resolve().parents[1]) in parts    # the environment's packages
    assert all(os.path.isabs(p) for p in parts)


def test_child_responses_equal_the_in_thread_service(child):
    """Every response (ids window, text offsets, finish reason, counts, acceptance) of streamed and whole requests in
    ar, dflash and ddtree: the same from the child as from a GenerationService in this process."""
    assert child.pid != os.getpid() and child.arm_names
    local = GenerationService(Engine(config()), Tokenizer(str(DEFAULT_TARGET)), max_queue_size=4)
    try:
        for mode in ("ar", "dflash", "ddtree"):
            for stream in (True, False):
                here, there = Sink(), Sink()
                local.submit("local", request(stream, mode), here)
                child.submit("child", request(stream, mode), there)
                expected, got = without_key(here.until_final()), without_key(there.until_final())
                assert got == expected, (mode, stream)
                assert got[-1][1][api.FINISH_REASON] in ("stop", "length") and (len(got) > 2) == stream
    finally:
        local.shutdown()


def test_cancelled_client_stops_the_request_in_the_child(child):
    sink = Sink()
    child.submit("cancel-me", request(True, "ar", max_tokens=400, ignore_eos=True), sink)
    assert sink.events.get(timeout=120)[0] == "out"
    sink.cancel = True
    events = sink.until_final()
    assert events[-1][:1] == ("cancelled",) and events[-1][2], events[-1]
    assert sum(1 for e in events if e[0] == "out") < 400
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (child.stats[-1].num_active or not child.stats[-1].num_cancelled):
        time.sleep(0.05)
    last = child.stats[-1]
    assert last.num_cancelled >= 1 and last.num_active == 0 and last.num_held_slots == 0


class SlowSink(Sink):
    """Triton's IPC as time: each ask of the client's cancellation 2 ms, each send 5 ms."""

    def is_cancelled(self) -> bool:
        time.sleep(0.002)
        return super().is_cancelled()

    def send(self, outputs, final):
        time.sleep(0.005)
        super().send(outputs, final)


def test_the_relay_publishes_its_own_sending_time(child):
    """ddtree_response_send_seconds_total and the cancellation asks count the stub's relay thread (the real sinks), not
    the child's pipe sends."""
    deadline = time.monotonic() + 30
    while not child.stats and time.monotonic() < deadline:
        time.sleep(0.05)
    before, sink = child.stats[-1], SlowSink()
    child.submit("slow", request(True, "ar", max_tokens=48, ignore_eos=True), sink)
    sent = sum(1 for event in sink.until_final() if event[0] == "out")

    def published():
        last = child.stats[-1]
        return (last.num_finished > before.num_finished and last.num_cancel_checks - before.num_cancel_checks == sink.asked
                and last.send_seconds - before.send_seconds >= 0.005 * sent)

    deadline = time.monotonic() + 30
    while not published() and time.monotonic() < deadline:
        time.sleep(0.05)
    last = child.stats[-1]
    assert sink.asked > 0 and last.num_cancel_checks - before.num_cancel_checks == sink.asked
    assert last.cancel_check_seconds - before.cancel_check_seconds >= 0.002 * sink.asked
    assert 0.005 * sent <= last.send_seconds - before.send_seconds < 0.005 * sent + 2.0


def test_metrics_are_published_off_the_relay_thread():
    """The stats reach on_stats on a thread of their own: put() returns while an update is still being published
    (a Triton metrics update is tens of IPC calls), and the snapshots that came meanwhile are published once, merged:
    the newest values with every snapshot's samples. close() publishes what is pending."""
    release, published = threading.Event(), []

    def on_stats(stats):
        published.append(vars(stats))
        release.wait(10)

    publisher = engine_process.MetricsPublisher(on_stats)
    try:
        publisher.put({"num_finished": 1, "ttft_seconds": [0.1]})
        deadline = time.monotonic() + 10
        while not published and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        publisher.put({"num_finished": 2, "ttft_seconds": [0.2]})
        publisher.put({"num_finished": 3, "ttft_seconds": [0.3, 0.4]})
        assert time.monotonic() - start < 0.5      # the relay goes on while the first update is still running
        assert len(published) == 1 and published[0]["num_finished"] == 1
    finally:
        release.set()
        publisher.close(10)
    own = ("metrics_publish_seconds", "num_metrics_publishes")   # the updates' own time, as of the update before
    assert [{k: v for k, v in p.items() if k not in own} for p in published] == [
        {"num_finished": 1, "ttft_seconds": [0.1]}, {"num_finished": 3, "ttft_seconds": [0.2, 0.3, 0.4]}]
    assert [p["num_metrics_publishes"] for p in published] == [0, 1] and published[0]["metrics_publish_seconds"] == 0
    assert published[1]["metrics_publish_seconds"] > 0   # the first update's time (it waited for release)


def test_a_slow_metrics_update_does_not_hold_up_responses(child, monkeypatch):
    """With every metrics update taking 0.5 s, a streamed request's responses still come round by round (the relay
    thread relayed them behind each update before: a 0.5 s stall every time the child published)."""
    def slow(stats):
        time.sleep(0.5)

    monkeypatch.setattr(child._publisher, "on_stats", slow)
    sink = Sink()
    child.submit("slow-metrics", request(True, "ar", max_tokens=48, ignore_eos=True), sink)
    arrivals, final = [], False
    while not final:
        kind, _, final = sink.events.get(timeout=120)
        assert kind == "out"
        arrivals.append(time.monotonic())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) > 5 and max(gaps) < 0.4, gaps


def test_stop_by_request_key_reaches_the_child(child):
    """The ensemble's postprocessing relays a client's cancellation as a stop request naming the request key."""
    sink = Sink()
    child.submit("stop-me", request(True, "ddtree", max_tokens=400, ignore_eos=True), sink)
    kind, outputs, _ = sink.events.get(timeout=120)
    assert kind == "out"
    assert child.stop(outputs[api.REQUEST_KEY]) is True
    assert sink.until_final()[-1][0] == "cancelled"
    assert child.stop("no-such-key") is False


def test_load_failure_names_the_childs_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"failed to load the engine:[\s\S]*Error"):
        EngineProcess(config(target_path=str(tmp_path / "missing")), tokenizer_path=str(DEFAULT_TARGET),
                      max_queue_size=4)


def test_a_dead_child_fails_its_requests_and_refuses_new_ones():
    stats: list = []
    process = EngineProcess(config(), tokenizer_path=str(DEFAULT_TARGET), max_queue_size=4)
    process.start(stats.append)
    try:
        running, waiting = Sink(), Sink()
        process.submit("running", request(True, "ar", max_tokens=400, ignore_eos=True), running)
        assert running.events.get(timeout=120)[0] == "out"
        process.submit("queued", request(True, "ar"), waiting)
        os.kill(process.pid, signal.SIGKILL)
        for sink in (running, waiting):
            kind, message, final = sink.until_final(30)[-1]
            assert kind == "unavailable" and final and "engine process" in message and "exited" in message, message
        assert not process.is_healthy
        later = Sink()
        start = time.monotonic()
        process.submit("later", request(True, "ar"), later)
        kind, message, final = later.until_final(5)[-1]
        assert kind == "unavailable" and "model unavailable" in message and time.monotonic() - start < 1
        deadline = time.monotonic() + 10   # the gauges' fall is published by the metrics thread
        while stats[-1].engine_healthy != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats[-1].engine_healthy == 0 and stats[-1].num_active == 0 and stats[-1].num_held_slots == 0
    finally:
        process.shutdown(5)


def test_an_orphaned_child_exits_even_while_busy():
    """The child's watch thread: once its parent is gone (a stub killed while the engine loads, when nothing reads the
    pipe), the child exits, whatever its main thread is doing (here: sleeping for an hour)."""
    code = ("import os, sys, threading, time; from ddtree.engine_process import _exit_with_parent; "
            "threading.Thread(target=_exit_with_parent, args=(int(sys.argv[1]), 0.05), daemon=True).start(); "
            "time.sleep(3600)")
    shell = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{code}" $$ > /dev/null 2>&1 & echo $!'],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": child_pythonpath()})
    orphan = int(shell.stdout.strip())   # its parent, the shell, has exited
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process_state(orphan) not in ("gone", "Z"):
        time.sleep(0.1)
    assert process_state(orphan) in ("gone", "Z")


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_relay_asks_about_cancellation_at_most_so_often_in_all(child, monkeypatch):
    """Two live requests (the engine's slots) asked at most CANCEL_ASKS_PER_S times a second in all (here 10: each every
    0.2 s, not every CANCEL_CHECK_S); a cancellation is still found, at the slower pace."""
    monkeypatch.setattr(cancellation, "CANCEL_ASKS_PER_S", 10.0)
    sinks = [Sink() for _ in range(2)]
    for i, sink in enumerate(sinks):
        child.submit(f"asked-{i}", request(True, "ar", max_tokens=400, ignore_eos=True), sink)
    for sink in sinks:
        assert sink.events.get(timeout=120)[0] == "out"
    asked, start = sum(s.asked for s in sinks), time.monotonic()
    time.sleep(1.5)
    rate = (sum(s.asked for s in sinks) - asked) / (time.monotonic() - start)
    for sink in sinks:
        sink.cancel = True
    for sink in sinks:
        assert sink.until_final()[-1][0] == "cancelled"
    assert rate <= 10.0 * 1.5, rate   # every 20 ms each would be 100 a second
