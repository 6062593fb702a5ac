"""stream_interval: a streamed request's text in fewer responses (the first text at once, then one every k rounds,
and the end), each decoded statelessly from its own window, concatenating to exactly what every-round streaming
gives (stop strings and split UTF-8 characters included); through the service, the same text and token counts."""

from __future__ import annotations

import gc
import logging
import random
import time

import pytest

from ddtree import api
from ddtree.config import EngineConfig
from ddtree.detokenize import decode, decode_range
from ddtree.engine import Engine
from ddtree.errors import InvalidRequest
from ddtree.request import RequestOutput
from ddtree.sampling_params import SamplingParams, sampling_params_from_dict
from ddtree.serving import GenerationService, StallWatch, _Stream
from ddtree.tokenizer import Tokenizer
from tests.unit.test_detokenize import TEXTS
from tests.unit.test_stop_strings import PROMPT, serve, stops_inside


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return Tokenizer(tiny_models / "qwen3-target")


def run_stream(tokenizer, ids: list[int], rounds: list[int], interval: int, stop: list[str],
               min_gap: float = 0.0) -> tuple[list[str], list]:
    """Feed ids to a _Stream in rounds of the given sizes, round n at time n; (texts the postprocessing decodes,
    responses)."""
    params = SamplingParams(max_tokens=len(ids), stop=stop, stream_interval=interval)
    req = api.GenerateRequest(prompt_ids=[1], params=params, stream=True, echo_text=None,
                              return_flags={name: True for name in api.RETURN_FLAGS})
    stream, texts, responses, i = _Stream(tokenizer, req), [], [], 0
    for n, size in enumerate(rounds):
        new, i = ids[i : i + size], i + size
        out = RequestOutput("r", new, "length" if i >= len(ids) else None, 1, i, n + 1, 1.0)
        outputs = stream.add(out, float(n), min_gap)
        if outputs is not None:
            texts.append(decode_range(tokenizer, outputs[api.OUTPUT_IDS], outputs[api.PREFIX_LENGTH],
                                      outputs[api.TEXT_START], outputs[api.TEXT_END]))
            responses.append(outputs)
        if stream.finish_reason is not None:
            break
    return texts, responses


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("interval, gap", [(2, 0.0), (3, 0.0), (8, 0.0), (1, 2.0), (1, 3.5), (2, 5.0)])
def test_held_rounds_decode_to_the_same_text(tokenizer, seed, interval, gap):
    """stream_interval, and stream_response_rate's gap between a stream's responses (here in rounds): the same text
    and token counts in fewer responses, the first text and the end still in the rounds that make them."""
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False) + [rng.randrange(len(tokenizer)) for _ in range(8)]
        rounds = [rng.randint(1, 4) for _ in range(len(ids))]
        for stop in ([], stops_inside(text, rng)):
            every, every_responses = run_stream(tokenizer, ids, rounds, 1, stop)
            held, held_responses = run_stream(tokenizer, ids, rounds, interval, stop, min_gap=gap)
            assert "".join(held) == "".join(every), (text, stop, interval, gap)
            assert held_responses[-1][api.FINISH_REASON] == every_responses[-1][api.FINISH_REASON] != ""
            num_rounds = every_responses[-1][api.NUM_ROUNDS]
            assert held_responses[-1][api.NUM_ROUNDS] == num_rounds
            # every token is counted once, in the response that carries it
            assert sum(r[api.NUM_OUTPUT_TOKENS] for r in held_responses) == \
                sum(r[api.NUM_OUTPUT_TOKENS] for r in every_responses)
            assert len(held_responses) <= 2 + num_rounds // interval
            # the first text goes out in the round that makes it, as without an interval
            first = next(r for r in every_responses if r[api.TEXT_END] > r[api.TEXT_START])
            assert held_responses[0][api.NUM_ROUNDS] == first[api.NUM_ROUNDS]
            # between the first and the last response, consecutive ones are at least the gap apart (round n at time
            # n: NUM_ROUNDS - 1 is when a response was built)
            sent_at = [r[api.NUM_ROUNDS] - 1 for r in held_responses[:-1]]
            assert all(b - a >= gap for a, b in zip(sent_at, sent_at[1:])), (sent_at, gap)


def test_stream_interval_parameter(tmp_path):
    config = EngineConfig(target_path="t", drafter_path="d", default_stream_interval=4)
    assert sampling_params_from_dict({}, config).stream_interval == 4
    assert sampling_params_from_dict({"stream_interval": 1}, config).stream_interval == 1
    for bad in (0, 2000, "x", 1.5):
        with pytest.raises(InvalidRequest, match="stream_interval"):
            sampling_params_from_dict({"stream_interval": bad}, config)
    with pytest.raises(ValueError, match="default_stream_interval"):
        EngineConfig(target_path="t", default_mode="ar", default_stream_interval=0)
    assert EngineConfig.from_dict({"target_path": "t", "default_mode": "ar",
                                   "default_stream_interval": "8"}).default_stream_interval == 8
    assert EngineConfig.from_dict({"target_path": "t", "default_mode": "ar",
                                   "stream_response_rate": "1500"}).stream_response_rate == 1500
    with pytest.raises(ValueError, match="stream_response_rate"):
        EngineConfig(target_path="t", default_mode="ar", stream_response_rate=-1)


def test_service_sends_fewer_responses_with_the_same_text(tiny_models, tokenizer):
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=128, max_num_seqs=2))
    service = GenerationService(engine, tokenizer, max_queue_size=4)
    sampling = {"max_tokens": 40, "ignore_eos": True, "mode": "ar"}
    try:
        every = serve(service, tokenizer, sampling, stream=True)
        held = serve(service, tokenizer, {**sampling, "stream_interval": 5}, stream=True)
        deadline = time.time() + 30
        while engine.has_work and time.time() < deadline:
            time.sleep(0.01)
    finally:
        service.shutdown()
    expected = decode(tokenizer, engine.generate_ids(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                            mode="ar")).output_ids)
    assert "".join(every.texts) == "".join(held.texts) == expected
    assert sum(o[api.NUM_OUTPUT_TOKENS] for o in held.outputs) == 40
    assert len(held.outputs) <= 2 + 40 // 5 < len(every.outputs)


def test_service_holds_streams_to_the_response_rate(tiny_models, tokenizer):
    """stream_response_rate=1 (one streamed response a second over all streams): a request that takes well under a
    second gets its first text and its end, the same text, every token counted."""
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=128, max_num_seqs=2,
                                 stream_response_rate=1))
    service = GenerationService(engine, tokenizer, max_queue_size=4)
    sampling = {"max_tokens": 40, "ignore_eos": True, "mode": "ar"}
    try:
        start = time.monotonic()
        held = serve(service, tokenizer, sampling, stream=True)
        elapsed = time.monotonic() - start
    finally:
        service.shutdown()
    expected = decode(tokenizer, engine.generate_ids(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                            mode="ar")).output_ids)
    assert "".join(held.texts) == expected
    assert sum(o[api.NUM_OUTPUT_TOKENS] for o in held.outputs) == 40
    assert len(held.outputs) <= 3 + int(elapsed), (len(held.outputs), elapsed)


def test_a_stalled_step_is_counted_and_logged_with_its_garbage_collection(tiny_models, tokenizer, caplog,
                                                                          monkeypatch):
    """A step far slower than the recent ones (here one that sleeps and runs a full collection) is a stall of every
    stream: counted (ddtree_slow_steps_total), logged with what was running and the collections in it; the others,
    and the service's output, are as usual. (Every stall logged here: a busy machine may stall another step.)"""
    monkeypatch.setattr(StallWatch, "LOG_EVERY_S", 0.0)
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=128, max_num_seqs=2))
    service = GenerationService(engine, tokenizer, max_queue_size=4)
    step, calls = engine.step, [0]

    def stalling_step():
        calls[0] += 1
        if calls[0] == 20:
            time.sleep(0.3)
            gc.collect()
        return step()

    engine.step = stalling_step
    sampling = {"max_tokens": 40, "ignore_eos": True, "mode": "ar"}
    try:
        with caplog.at_level(logging.WARNING, logger="ddtree.serving"):
            out = serve(service, tokenizer, sampling, stream=True)
    finally:
        service.shutdown()
    expected = decode(tokenizer, engine.generate_ids(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                            mode="ar")).output_ids)
    assert calls[0] > 20 and "".join(out.texts) == expected
    assert service.stats.num_slow_steps >= 1 and service.stats.slow_step_seconds >= 0.3
    assert service.stats.num_full_gcs >= 1 and service.stats.gc_seconds > 0
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == service.stats.num_slow_steps
    assert any("1 running" in m and "1 full" in m and "programs made in it 0" in m and "dynamic forwards in it" in m
               for m in stalls), stalls
