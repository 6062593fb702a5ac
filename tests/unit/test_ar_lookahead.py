"""The `ar` lookahead (EngineConfig.ar_lookahead): a lone greedy `ar` request's next step is queued before its token is
read. On the CPU the static forwards run eagerly (static_forward="on"), so the same queueing runs here as on the GPU:
every output equals the plain engine's (dense and hybrid targets), whether the request runs out of tokens, hits a
stop id, is aborted with a step queued (its slot then serves another request), or another request arrives while a
step is queued (the queued step becomes a round of its own, then the two decode together)."""

from __future__ import annotations

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
    base = dict(target_path=target, drafter_path=drafter, max_model_len=160, max_num_seqs=2, static_forward="on", **kw)
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
    plain, ahead = engines(family, tiny_models, hybrid)
    params = SamplingParams(mode="ar", max_tokens=40, ignore_eos=True)
    ahead.add(Request("gone", prompt(3), params))
    for _ in range(6):
        ahead.step()
    assert ahead._ahead is not None and ahead._ahead.seq.request.request_id == "gone"
    assert ahead.abort("gone") and ahead._ahead is None and not ahead.running
    expected = plain.generate_ids(prompt(4), params).output_ids
    assert ahead.generate_ids(prompt(4), params).output_ids == expected


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_a_request_arriving_while_a_step_is_queued(family, tiny_models, hybrid):
    """The queued step is settled as a round of its own; then both decode together, then the survivor alone again
    (queueing once more): every token equals the plain engine's, for the same arrivals."""
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
        engine.add(second)
        engine.step()   # settles the queued step, prefills the second; the first's round still runs alone
        engine.step()
        if engine is ahead:
            assert engine._ahead is None and len(engine.running) == 2   # two requests decode the usual way
        run_all(engine, [])
        outputs[engine is ahead] = (first.output_ids, second.output_ids)
    assert outputs[True] == outputs[False]
    assert len(outputs[True][0]) == 30 and len(outputs[True][1]) == 8
    assert ahead.stage_times.lookahead_steps > 5   # queued before the arrival, and again after the second left


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
