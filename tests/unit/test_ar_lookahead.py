"""The `ar` lookahead (EngineConfig.ar_lookahead): a lone greedy `ar` request's next step is queued before its token is
read. On the CPU the static forwards run eagerly (static_forward="on"), so the same queueing runs here as on the GPU:
every output equals the plain engine's (dense and hybrid targets), whether the request runs out of tokens, hits a
stop id, is aborted with a step queued (its slot then serves another request), or another request arrives while a
step is queued (its prefill runs behind it, then the two decode together)."""

from __future__ import annotations

import time

import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.request import Request
from ddtree.sampling_params import SamplingParams
from tests.unit.oracle import make_tiny_hybrid


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root, _ = make_tiny_hybrid(tmp_path_factory.mktemp("lookahead"))
    return root


def paths(family, tiny_models, hybrid) -> tuple[str, str]:
    if family == "hybrid":
        return str(hybrid / "target"), str(hybrid / "dflash")
    return str(tiny_models / "qwen3-target"), str(tiny_models / "qwen3-dflash")


def engines(family, tiny_models, hybrid, **kw) -> tuple[Engine, Engine]:
    target, drafter = paths(family, tiny_models, hybrid)
    base = dict(target_path=target, drafter_path=drafter, max_model_len=160, max_num_seqs=2, static_forward="on")
    base.update(kw)
    return Engine(EngineConfig(**base)), Engine(EngineConfig(**base, ar_lookahead=True))


def prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(engine: Engine, requests: list[Request]) -> None:
    for request in requests:
        engine.add(request)
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_lookahead_decodes_what_the_engine_decodes_without(family, tiny_models, hybrid):
    plain, ahead = engines(family, tiny_models, hybrid)
    for i, max_tokens in enumerate([1, 2, 13, 40]):
        params = SamplingParams(mode="ar", max_tokens=max_tokens, ignore_eos=True)
        expected = plain.generate_ids(prompt(i), params).output_ids
        assert ahead.generate_ids(prompt(i), params).output_ids == expected, (family, max_tokens)
    # the prefill gives the first token; every round but a request's last queues the next step (max_tokens 13: 12
    # rounds, 11 queued; 40: 39 rounds, 38 queued)
    assert ahead.stage_times.lookahead_steps == 11 + 38 and plain.stage_times.lookahead_steps == 0
    # a stop id in the middle: the request ends there, its queued step is dropped, and the next request (same slot)
    # decodes what it decodes alone
    free = plain.generate_ids(prompt(7), SamplingParams(mode="ar", max_tokens=30, ignore_eos=True)).output_ids
    stop = SamplingParams(mode="ar", max_tokens=30, ignore_eos=True, stop_token_ids=[free[9]])
    cut = free[: free.index(free[9]) + 1]
    assert ahead.generate_ids(prompt(7), stop).output_ids == plain.generate_ids(prompt(7), stop).output_ids == cut
    assert ahead._ahead is None
    after = SamplingParams(mode="ar", max_tokens=20, ignore_eos=True)
    assert ahead.generate_ids(prompt(8), after).output_ids == plain.generate_ids(prompt(8), after).output_ids


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_an_aborted_request_leaves_no_queued_step_behind(family, tiny_models, hybrid):
    """The aborted request's queued step is skipped by the next step (its slot then serves another request)."""
    plain, ahead = engines(family, tiny_models, hybrid)
    params = SamplingParams(mode="ar", max_tokens=40, ignore_eos=True)
    ahead.add(Request("gone", prompt(3), params))
    for _ in range(6):
        ahead.step()
    assert ahead._ahead is not None and ahead._ahead.seqs[0].request.request_id == "gone"
    assert ahead.abort("gone") and not ahead.running
    expected = plain.generate_ids(prompt(4), params).output_ids
    assert ahead.generate_ids(prompt(4), params).output_ids == expected
    assert ahead._ahead is None


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_a_request_arriving_while_a_step_is_queued(family, tiny_models, hybrid):
    """The arrival's prefill runs behind the queued step, which the first request's round consumes; the step queued
    behind that one is settled as a round of its own next; then both decode together (their steps queued together),
    then the survivor alone again: every token equals the plain engine's, for the same arrivals."""
    plain, ahead = engines(family, tiny_models, hybrid)
    outputs = {}
    for engine in (plain, ahead):
        first = Request("first", prompt(5), SamplingParams(mode="ar", max_tokens=30, ignore_eos=True))
        second = Request("second", prompt(6, 9), SamplingParams(mode="ar", max_tokens=8, ignore_eos=True))
        engine.add(first)
        for _ in range(5):
            engine.step()
        if engine is ahead:
            assert engine._ahead is not None
        settled = []
        if engine is ahead:
            real = engine._settle_ahead
            engine._settle_ahead = lambda real=real: settled.append(len(engine.running)) or real()
        engine.add(second)
        engine.step()   # prefills the second behind the first's queued step, which the first's round consumes
        if engine is ahead:   # no wait for it: the second's first token read after that round
            assert settled == [] and len(second.output_ids) == 1 and len(first.output_ids) == 6
        engine.step()
        if engine is ahead:   # the first's next queued step settled; the two decode together, queueing together
            assert settled == [2] and len(engine.running) == 2 and engine._ahead.matches(engine.running)
        run_all(engine, [])
        outputs[engine is ahead] = (first.output_ids, second.output_ids)
    assert outputs[True] == outputs[False]
    assert len(outputs[True][0]) == 30 and len(outputs[True][1]) == 8
    assert ahead.stage_times.lookahead_steps > 5   # queued before the arrival, and again after the second left


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_arrivals_that_stop_at_once_sample_or_make_one_token(family, tiny_models, hybrid):
    """Arrivals while the running request's step is queued, one a step: one whose first token is a stop id, one that
    samples (its first token chosen at once, not after the round), one with a single token to make, and one that goes
    on: every request decodes what the plain engine decodes for the same arrivals."""
    plain, ahead = engines(family, tiny_models, hybrid, max_num_seqs=4)
    first_token = plain.generate_ids(prompt(6, 9), SamplingParams(mode="ar", max_tokens=1)).output_ids[0]
    outputs = {}
    for engine in (plain, ahead):
        first = Request("first", prompt(5), SamplingParams(mode="ar", max_tokens=30, ignore_eos=True))
        engine.add(first)
        for _ in range(4):
            engine.step()
        arrivals = [Request("stops", prompt(6, 9), SamplingParams(mode="ar", max_tokens=8, stop_token_ids=[first_token])),
                    Request("samples", prompt(7, 9), SamplingParams(mode="ar", max_tokens=6, temperature=1.0, seed=2)),
                    Request("one", prompt(8, 9), SamplingParams(mode="ar", max_tokens=1, ignore_eos=True)),
                    Request("goes_on", prompt(9, 9), SamplingParams(mode="ar", max_tokens=7, ignore_eos=True))]
        for i, request in enumerate(arrivals):
            engine.add(request)
            engine.step()
            if engine is ahead and i == 0:   # reported in the step that admitted it, after the first's round
                assert request.finish_reason == "stop" and len(first.output_ids) == 5
        run_all(engine, [])
        outputs[engine is ahead] = [r.output_ids for r in [first, *arrivals]]
    assert outputs[True] == outputs[False]
    assert outputs[True][1] == [first_token] and len(outputs[True][3]) == 1 and len(outputs[True][4]) == 7


def test_sampling_and_other_modes_do_not_queue(tiny_models, hybrid):
    plain, ahead = engines("qwen3", tiny_models, hybrid)
    for params in (SamplingParams(mode="ar", max_tokens=10, ignore_eos=True, temperature=1.0, seed=3),
                   SamplingParams(mode="ddtree", tree_budget=8, max_tokens=10, ignore_eos=True),
                   SamplingParams(mode="ar", max_tokens=10, min_tokens=4)):
        assert ahead.generate_ids(prompt(1), params).output_ids == plain.generate_ids(prompt(1), params).output_ids
    assert ahead.stage_times.lookahead_steps == 0


def test_lookahead_is_on_by_default_only_where_static_forwards_are_cuda_graphs(tiny_models):
    """ar_lookahead None ("auto"): on for a CUDA engine with graphs; the CPU's eager static forwards gain nothing from
    queueing (the host runs them), so they keep the plain round unless asked."""
    base = dict(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                max_model_len=128, static_forward="on")
    assert Engine(EngineConfig(**base)).ar_lookahead is False
    assert Engine(EngineConfig(**base, ar_lookahead=True)).ar_lookahead is True


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_auto_on_the_ar_arm_queues_its_steps_and_keeps_the_drafters_context(family, tiny_models, hybrid):
    """Mode `auto` on its `ar` arm queues steps too (arms scripted: `ar` runs, a `dflash` and a `ddtree` round between
    them). A round on another arm settles the queued step first (a hybrid's recurrent state has moved past it), and
    each queued step's target features join the drafter's context (the engine asserts the drafter's context keeps
    step with the target), so the output is the plain engine's."""
    from ddtree.budget import Arm

    plain, ahead = engines(family, tiny_models, hybrid)
    script = [Arm("ar")] * 3 + [Arm("dflash")] + [Arm("ar")] * 4 + [Arm("ddtree", 16)] + [Arm("ar")] * 2
    for engine in (plain, ahead):
        calls = iter(range(10**6))
        engine.arm_selector.choose = lambda num_seqs, max_budget=None, chain=True, calls=calls: script[next(calls) % len(script)]
    params = SamplingParams(mode="auto", tree_budget=16, max_tokens=70, ignore_eos=True)
    expected = plain.generate_ids(prompt(3), params).output_ids
    assert ahead.generate_ids(prompt(3), params).output_ids == expected
    rounds = ahead.stage_times.auto_arm_rounds
    assert ahead.stage_times.lookahead_steps > 10 and plain.stage_times.lookahead_steps == 0
    assert rounds["dflash"] >= 2 and rounds["ddtree-16"] >= 2, rounds   # arms switched, queued steps settled


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_a_batch_queues_its_steps_together(family, tiny_models, hybrid):
    """Several greedy `ar` requests queue one batched step (each request's input id its own row's argmax), through
    arrivals, a request that runs out of tokens or hits a stop id while the others go on (their tokens read, its
    skipped), and an abort: every token equals the plain engine's, for the same arrivals."""
    plain, ahead = engines(family, tiny_models, hybrid, max_num_seqs=4)
    free = plain.generate_ids(prompt(20), SamplingParams(mode="ar", max_tokens=30, ignore_eos=True)).output_ids
    queued = []
    real = ahead._queue_step
    ahead._queue_step = lambda seqs, *args: queued.append(len(seqs)) or real(seqs, *args)
    outputs = {}
    for engine in (plain, ahead):
        requests = [Request("a", prompt(20), SamplingParams(mode="ar", max_tokens=30, ignore_eos=True,
                                                            stop_token_ids=[free[11]])),
                    Request("b", prompt(21, 7), SamplingParams(mode="ar", max_tokens=6, ignore_eos=True)),
                    Request("c", prompt(22, 15), SamplingParams(mode="ar", max_tokens=40, ignore_eos=True)),
                    Request("d", prompt(23, 10), SamplingParams(mode="ar", max_tokens=25, ignore_eos=True))]
        for request in requests[:2]:
            engine.add(request)
        for _ in range(3):
            engine.step()
        for request in requests[2:]:
            engine.add(request)
        while len(requests[3].output_ids) < 8:
            engine.step()
        assert engine.abort("d")
        at_abort = list(requests[3].output_ids)
        run_all(engine, [])
        assert requests[3].output_ids == at_abort   # its queued row skipped, nothing reported for it after
        outputs[engine is ahead] = [r.output_ids for r in requests]
    # d's tokens when aborted: a step that settles a queued step decodes twice, so the count at the abort may differ
    d_plain, d_ahead = outputs[False].pop(), outputs[True].pop()
    n = min(len(d_plain), len(d_ahead))
    assert n >= 8 and d_plain[:n] == d_ahead[:n]
    assert outputs[True] == outputs[False]
    assert outputs[True][0][-1] == free[11] and len(outputs[True][1]) == 6 and len(outputs[True][2]) == 40
    assert max(queued) >= 3 and 2 in queued and ahead.stage_times.lookahead_steps > 20
    assert ahead._ahead is None


def test_auto_queues_a_lone_requests_and_a_batchs_steps_where_graphed(tiny_models, hybrid):
    """ar_lookahead "auto" is off on the CPU (no CUDA graphs); on where they are (forced here as CUDA gives it) it
    queues a batch's steps as well as a lone request's, and decodes what the plain engine decodes."""
    plain, _ = engines("qwen3", tiny_models, hybrid)
    auto, _ = engines("qwen3", tiny_models, hybrid)
    assert not auto.ar_lookahead   # the CPU: "auto" is off
    auto.ar_lookahead = True   # what "auto" gives a CUDA engine with graphs
    def batch() -> list[Request]:
        return [Request(name, prompt(seed), SamplingParams(mode="ar", max_tokens=n, ignore_eos=True))
                for name, seed, n in (("x", 30, 6), ("y", 31, 20))]
    queued = []
    real = auto._queue_step
    auto._queue_step = lambda seqs, *args: queued.append(len(seqs)) or real(seqs, *args)
    requests, control = batch(), batch()
    run_all(auto, requests)
    run_all(plain, control)
    assert {1, 2} <= set(queued), queued   # the pair's steps, then the survivor's alone after the other's last token
    assert [r.output_ids for r in requests] == [r.output_ids for r in control]


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_features_waiting_for_a_draft_are_folded_into_the_drafters_context(family, tiny_models, hybrid):
    """Two `auto` requests on the `ar` arm keep their target features for a later draft; past fold_chunks rounds
    without one they are written into the drafter's context (Engine._fold_contexts), so what waits stays bounded.
    Folding every 6 rounds (with the lookahead queueing the steps) drafts the same hidden states, accepts the same
    tokens and decodes the same output as keeping every feature to the next draft (arms scripted: long `ar` runs
    between `dflash` and `ddtree` rounds)."""
    from ddtree.budget import Arm

    (_, plain), (_, folding) = engines(family, tiny_models, hybrid), engines(family, tiny_models, hybrid)
    plain.fold_chunks, folding.fold_chunks = 10**9, 6
    script = [Arm("ar")] * 20 + [Arm("dflash")] * 2 + [Arm("ar")] * 9 + [Arm("ddtree", 16)]
    results = []
    for engine in (plain, folding):
        calls = iter(range(10**6))
        engine.arm_selector.choose = lambda num_seqs, max_budget=None, chain=True, calls=calls: script[next(calls) % len(script)]
        drafts, real = [], engine._draft_hidden
        engine._draft_hidden = lambda seqs, real=real, drafts=drafts: drafts.append(real(seqs).clone()) or drafts[-1]
        requests = [Request(f"r{i}", prompt(30 + i, 10 + 7 * i),
                            SamplingParams(mode="auto", tree_budget=16, max_tokens=90, ignore_eos=True)) for i in range(2)]
        for request in requests:
            engine.add(request)
        waiting = 0
        while engine.has_work:
            engine.step()
            waiting = max([waiting] + [len(seq.pending_taps) for seq in engine.running])
        results.append(([r.output_ids for r in requests], [r.acceptance_lengths for r in requests], drafts, waiting))
    (outputs, accepted, drafts, waiting), (f_outputs, f_accepted, f_drafts, f_waiting) = results
    assert f_outputs == outputs and f_accepted == accepted
    assert len(f_drafts) == len(drafts) >= 4
    for ours, theirs in zip(f_drafts, drafts):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert folding.stage_times.folded_rows > 0 and plain.stage_times.folded_rows == 0
    assert f_waiting <= 6 < waiting, (f_waiting, waiting)


def test_the_host_time_never_goes_down_when_a_queued_step_is_settled(tiny_models, hybrid):
    """A queued step settled as a round of its own (an arrival) counts its time as a decoding round's: the host time
    (decode less draft and verify) was lowered by it, and the metric that publishes it, a counter, then refused the
    update (and the fields after it went unpublished)."""
    _, ahead = engines("qwen3", tiny_models, hybrid, max_num_seqs=4)
    ahead.add(Request("first", prompt(5), SamplingParams(mode="ar", max_tokens=30, ignore_eos=True)))
    settled, real, advance = [], ahead._settle_ahead, ahead._advance_steps

    def settle():   # a settle that waits on the device as a GPU's does (its read and commit inside its timed window)
        settled.append(1)
        ahead._advance_steps = lambda *a: time.sleep(0.02) or advance(*a)
        try:
            return real()
        finally:
            ahead._advance_steps = advance

    ahead._settle_ahead = settle
    hosts, arrivals = [], iter(range(6))
    while ahead.has_work:
        if len(hosts) % 3 == 2 and (i := next(arrivals, None)) is not None:   # an arrival every third step
            ahead.add(Request(f"arrival-{i}", prompt(10 + i, 9), SamplingParams(mode="ar", max_tokens=4, ignore_eos=True)))
        ahead.step()
        times = ahead.stage_times
        hosts.append(times.host)
        assert times.decode >= times.draft + times.verify - 1e-9
    assert settled, "no queued step was settled outside a round: the test did not test it"
    assert all(b >= a - 1e-9 for a, b in zip(hosts, hosts[1:])), hosts
