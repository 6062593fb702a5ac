"""Stop strings: the text ends right before the first one, streamed or not, and the request leaves the batch."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from ddtree import api
from ddtree.config import EngineConfig
from ddtree.detokenize import IncrementalDetokenizer, decode, decode_range, find_stop, stop_prefix_length
from ddtree.engine import Engine
from ddtree.errors import InvalidRequest
from ddtree.sampling_params import SamplingParams
from ddtree.serving import GenerationService
from ddtree.tokenizer import Tokenizer
from tests.unit.test_detokenize import TEXTS

PROMPT = [100, 200, 300]          # the tiny random target's greedy text has runs of plain characters
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return Tokenizer(tiny_models / "qwen3-target")


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                               max_model_len=128, max_num_seqs=2))


def parse_sampling(values) -> SamplingParams:
    config = EngineConfig(target_path="t", drafter_path="d")
    return api.parse_generate({api.INPUT_IDS: [1], api.SAMPLING_PARAMETERS: json.dumps(values).encode()}, config).params


def test_stop_parameter_forms():
    assert parse_sampling({"stop": "\n\n"}).stop == ["\n\n"]
    assert parse_sampling({"stop": ["a", "bc"]}).stop == ["a", "bc"]
    assert parse_sampling({"stop": None}).stop == parse_sampling({}).stop == []


@pytest.mark.parametrize("value,match", [
    (["x"] * 17, "at most 16"),
    ([""], "1 to 256 characters, got 0"),
    (["x" * 257], "1 to 256 characters, got 257"),
    ("", "1 to 256 characters"),
    (["a", 3], "a string or a list of strings"),
    (7, "a string or a list of strings"),
])
def test_bad_stop_parameter(value, match):
    with pytest.raises(InvalidRequest, match=match):
        parse_sampling({"stop": value})


def test_find_stop_and_held_prefix():
    assert find_stop("hello world", ["wor", "lo"]) == 3
    assert find_stop("hello", ["x"]) is None
    assert stop_prefix_length("abc ab", ["abd"]) == 2
    assert stop_prefix_length("abc abc", ["abcd", "c ab"]) == 3
    assert stop_prefix_length("abc", ["c"]) == 0           # a whole stop string is found, never held
    assert stop_prefix_length("ab", ["xabz"]) == 0


def stream_pieces(tokenizer, ids, stop, rng):
    """Push ids a few at a time, as rounds commit them; check every chunk on the way.

    Returns the pieces and the text of all ids pushed when a stop string ended the output (None if none did).
    """
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4)
        new, i = ids[i : i + step], i + step
        chunk = detok.push(new, is_final=i >= len(ids))
        assert decode_range(tokenizer, chunk.window, chunk.prefix_length, chunk.text_start, chunk.text_end) == chunk.text
        pieces.append(chunk.text)
        so_far = decode(tokenizer, ids[:i])
        if chunk.stopped:
            return pieces, so_far
        assert find_stop(so_far, stop) is None
        if i < len(ids) and not so_far.endswith("\ufffd"):   # sent: all but the longest tail that may begin a stop
            assert "".join(pieces) == so_far[: len(so_far) - stop_prefix_length(so_far, stop)]
    return pieces, None


def stops_inside(text: str, rng: random.Random) -> list[str]:
    """Two stop strings cut from the text at random (several tokens long, starting anywhere), one absent."""
    found = []
    for _ in range(2):
        start = rng.randrange(len(text) - 4)
        found.append(text[start : start + rng.randint(2, 12)])
    return found + ["\u2603never"]


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_ends_before_the_first_stop_string(tokenizer, seed):
    """The output ends at the round where a stop string first completes, right before that occurrence
    (the earliest one in that round's text: overlapping stop strings resolve as in vLLM)."""
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        stop = stops_inside(text, rng)
        pieces, so_far = stream_pieces(tokenizer, ids, stop, rng)
        assert so_far is not None and "".join(pieces) == so_far[: find_stop(so_far, stop)], (text, stop)
        assert len("".join(pieces)) <= find_stop(text, stop) + max(map(len, stop))


def test_prefix_of_a_stop_string_is_released_when_it_does_not_complete(tokenizer):
    text = TEXTS[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in (["How are you yesterday"], ["lines.\n\n"], ["\n."]):
        pieces, stopped_at = stream_pieces(tokenizer, ids, stop, random.Random(0))
        assert stopped_at is None and "".join(pieces) == text


@pytest.mark.parametrize("stopped", [True, False])
def test_stop_strings_count_only_after_min_tokens(tokenizer, stopped):
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    n = first_tokens_containing(tokenizer, ids, "Hello")
    detok = IncrementalDetokenizer(tokenizer, ["Hello"], min_tokens=0 if stopped else n)
    assert detok.push(ids[:n], is_final=False).stopped == stopped
    detok.push(ids[n:], is_final=True)
    assert detok.text == ("" if stopped else TEXTS[0])


class Sink:
    def __init__(self, tokenizer):
        self.tokenizer, self.texts, self.outputs, self.done = tokenizer, [], [], threading.Event()

    def is_cancelled(self):
        return False

    def send(self, outputs, final):
        """A response's text: the model's own (text_output), else what the postprocessing step makes of its ids."""
        if api.TEXT_OUTPUT in outputs:
            self.texts.append(outputs[api.TEXT_OUTPUT])
        else:
            window, prefix = outputs[api.OUTPUT_IDS], outputs[api.PREFIX_LENGTH]
            self.texts.append(decode_range(self.tokenizer, window, prefix, outputs[api.TEXT_START], outputs[api.TEXT_END]))
        self.outputs.append(outputs)
        if final:
            self.done.set()

    def send_error(self, message, kind, final=True):
        self.outputs.append({"error": message})
        self.done.set()


def serve(service, tokenizer, sampling, stream) -> Sink:
    inputs = {api.INPUT_IDS: PROMPT, api.SAMPLING_PARAMETERS: json.dumps(sampling).encode(), api.STREAM: stream,
              api.EXCLUDE_INPUT_IN_OUTPUT: True, "return_finish_reason": True, "return_num_output_tokens": True}
    sink = Sink(tokenizer)
    service.submit("test", api.parse_generate(inputs, service.engine.config), sink)
    assert sink.done.wait(120)
    return sink


def first_tokens_containing(tokenizer, ids, stop) -> int:
    return next(n for n in range(1, len(ids) + 1) if stop in decode(tokenizer, ids[:n]))


def pick_stop(tokenizer, ids, length: int = 5) -> str:
    """A stop string of plain characters from the text of ids, after the 6th token, spanning several tokens."""
    text = decode(tokenizer, ids)
    for start in range(len(decode(tokenizer, ids[:6])), len(text) - length):
        stop = text[start : start + length]
        first = text.find(stop)
        tokens_before = max(n for n in range(len(ids)) if len(decode(tokenizer, ids[:n])) <= first)
        if "\ufffd" not in stop and first_tokens_containing(tokenizer, ids, stop) - tokens_before >= 2:
            return stop
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.mark.parametrize("mode, sends", [("ar", "outbox"), ("ddtree", "outbox"), ("ddtree", "inline"),
                                         ("ar", "gated"), ("ddtree", "gated")])
def test_service_stops_the_request_at_the_round_that_completes_the_stop_string(engine, tokenizer, mode, sends,
                                                                               monkeypatch):
    """inline: DDTREE_INLINE_SENDS=1, responses sent from the engine thread (no outbox thread); gated:
    DDTREE_OUTBOX_GATE=1, the outbox's calls held for the engine thread's device reads (a CUDA engine's default): the
    same stream."""
    inline = sends == "inline"
    monkeypatch.setenv("DDTREE_INLINE_SENDS", "1" if inline else "0")
    monkeypatch.setenv("DDTREE_OUTBOX_GATE", "1" if sends == "gated" else "0")
    sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "mode": mode, "tree_budget": 8}
    free_ids = engine.generate_ids(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, mode=mode,
                                                          tree_budget=8)).output_ids
    free, stop = decode(tokenizer, free_ids), pick_stop(tokenizer, free_ids)
    expected = free[: free.find(stop)]
    service = GenerationService(engine, tokenizer, max_queue_size=4)
    assert service._outbox._thread.is_alive() is not inline
    assert (engine.wait_gate is not None) is (sends == "gated") and engine.wait_gate is service._outbox.gate
    try:
        streamed = serve(service, tokenizer, {**sampling, "stop": ["\u2603", stop]}, stream=True)
        whole = serve(service, tokenizer, {**sampling, "stop": stop}, stream=False)
        deadline = time.time() + 30
        while engine.has_work and time.time() < deadline:
            time.sleep(0.01)
    finally:
        service.shutdown()
    assert "".join(streamed.texts) == whole.texts[0] == expected and len(whole.texts) == 1
    assert len(streamed.texts) > 2, "the text should arrive in several responses"
    for sink in (streamed, whole):
        assert sink.outputs[-1][api.FINISH_REASON] == "stop"
        tokens = sum(o[api.NUM_OUTPUT_TOKENS] for o in sink.outputs)
        needed = first_tokens_containing(tokenizer, free_ids, stop)
        assert needed <= tokens < MAX_TOKENS   # the request left at the round that completed the stop string
        if mode == "ar":
            assert tokens == needed
    assert not engine.running and len(engine.free_slots) == engine.config.max_num_seqs
