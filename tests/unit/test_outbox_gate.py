"""The outbox's gate: its calls wait for the engine thread's device reads (Engine.wait_gate), for at most GATE_WAIT_S;
the engine opens the gate around every read of a round and closes it after; closing the outbox drains it at once."""

from __future__ import annotations

import threading
import time

import pytest

from ddtree import serving
from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams
from ddtree.serving import Outbox

PROMPT = [100, 200, 300]


class RecordingGate(threading.Event):
    """A gate that counts its openings and closings, and checks that they alternate."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = self.closed = 0

    def set(self) -> None:
        assert not self.is_set(), "opened twice without closing"
        self.opened += 1
        super().set()

    def clear(self) -> None:
        assert self.is_set(), "closed without opening"
        self.closed += 1
        super().clear()


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def queued_behind_a_shut_gate(n: int) -> tuple[Outbox, list[int], float]:
    """An outbox whose gate never opens with n calls queued (call i appends i to the list), and when they were queued."""
    done: list[int] = []
    outbox = Outbox(gate=threading.Event())
    start = time.monotonic()
    for i in range(n):
        outbox.put(done.append, i)
    return outbox, done, start


def test_a_call_waits_for_the_gate(monkeypatch):
    monkeypatch.setattr(serving, "GATE_WAIT_S", 30.0)
    gate, done = threading.Event(), []
    outbox = Outbox(gate=gate)
    outbox.put(done.append, 1)
    time.sleep(0.2)
    assert done == [], "the call ran while the gate was closed"
    gate.set()
    assert wait_for(lambda: done == [1])
    outbox.close(5.0)


def test_a_closed_gate_holds_a_call_only_so_long(monkeypatch):
    monkeypatch.setattr(serving, "GATE_WAIT_S", 0.05)
    outbox, done, _ = queued_behind_a_shut_gate(3)
    assert wait_for(lambda: done == [0, 1, 2])
    outbox.close(5.0)


def test_closing_drains_without_waiting_for_the_gate(monkeypatch):
    """Only a call already waiting when the outbox closes can wait (GATE_WAIT_S at most); the rest go at once."""
    monkeypatch.setattr(serving, "GATE_WAIT_S", 2.0)
    outbox, done, start = queued_behind_a_shut_gate(3)
    outbox.close(30.0)
    assert done == [0, 1, 2] and time.monotonic() - start < 4.5   # 6 s if each had waited


@pytest.mark.parametrize("mode", ["ar", "dflash", "ddtree"])
def test_the_engine_opens_the_gate_around_each_read(tiny_models, mode):
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=128, max_num_seqs=2))
    params = SamplingParams(max_tokens=12, ignore_eos=True, mode=mode, tree_budget=8)
    expected = engine.generate_ids(PROMPT, params).output_ids
    engine.wait_gate = gate = RecordingGate()
    times = engine.stage_times
    rounds, drafts = times.batch_rounds, times.draft_passes
    request = engine.generate_ids(PROMPT, params)
    rounds, drafts = times.batch_rounds - rounds, times.draft_passes - drafts
    assert request.output_ids == expected
    assert (drafts == 0) is (mode == "ar") and drafts < rounds   # the last round (one token left) drafts nothing
    # a read a round (the verify's choices), on the host path one more for each draft (its top ids or top-k), and the
    # prefill's first token (read after the step's round: Engine._resolve_firsts): each inside an opening
    assert gate.opened == gate.closed == rounds + drafts + 1 and not gate.is_set()


def test_a_closed_gate_holds_each_call_from_when_it_was_queued(monkeypatch):
    """A call's wait for the gate counts from when it was queued: calls queued together behind one that waited go at
    once (a wait per call capped the outbox at 1 / GATE_WAIT_S calls a second: at 32 streams on the H200, host-bound
    rounds that rarely wait on the device held responses back until the clients' streams thinned out)."""
    monkeypatch.setattr(serving, "GATE_WAIT_S", 0.1)
    outbox, done, start = queued_behind_a_shut_gate(20)
    assert wait_for(lambda: len(done) == 20)
    elapsed = time.monotonic() - start
    assert done == list(range(20)) and 0.09 < elapsed < 0.6, elapsed   # 2 s if each had waited its own 0.1 s
    outbox.close(5.0)
