"""The generation model alone, text in and text out (no ensemble around it): a prompt sent as text_input or messages is
tokenized by the model and answered with text_output, the same text the ensemble's postprocessing makes of the ids."""

from __future__ import annotations

import json

import pytest

from ddtree import api
from ddtree.config import EngineConfig
from ddtree.detokenize import decode
from ddtree.engine import Engine
from ddtree.errors import InvalidRequest
from ddtree.serving import GenerationService
from ddtree.tokenizer import Tokenizer
from tests.unit.test_stop_strings import Sink

CONFIG = EngineConfig(target_path="t", drafter_path="d", max_tokens_limit=512)
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Write a haiku about trees."}]


class CountingTokenizer(Tokenizer):
    """The real tokenizer, counting the prompts it encodes."""

    calls = 0

    def encode(self, *args, **kwargs):
        self.calls += 1
        return super().encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return super().apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return CountingTokenizer(tiny_models / "qwen3-target")


@pytest.fixture(scope="module")
def service(tiny_models, tokenizer):
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=128, max_num_seqs=2))
    service = GenerationService(engine, tokenizer)
    yield service
    service.shutdown()


def test_a_text_prompt_is_tokenized_and_answered_with_text(tokenizer):
    request = api.parse_generate({api.TEXT_INPUT: PROMPT.encode()}, CONFIG, tokenizer)
    assert request.text_output and request.prompt_ids == tokenizer.encode(PROMPT, add_special_tokens=True)
    assert request.echo_text == PROMPT   # not streamed: echoed unless excluded, as the ensemble does
    chat = api.parse_generate({api.TEXT_INPUT: b"", api.MESSAGES: json.dumps(MESSAGES).encode()}, CONFIG, tokenizer)
    assert chat.text_output and chat.prompt_ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = api.parse_generate({api.INPUT_IDS: [5, 6], api.TEXT_INPUT: PROMPT.encode()}, CONFIG, tokenizer)
    assert not ids.text_output and ids.prompt_ids == [5, 6]   # the ensemble's step: ids in, ids out


@pytest.mark.parametrize("inputs,match", [
    ({}, "text_input is empty"),
    ({api.TEXT_INPUT: b""}, "text_input is empty"),
    ({api.MESSAGES: b"[]"}, "messages must not be empty"),
    ({api.TEXT_INPUT: b"\xff"}, "text_input is not valid UTF-8"),
])
def test_a_bad_text_prompt_is_a_clear_error(tokenizer, inputs, match):
    with pytest.raises(InvalidRequest, match=match):
        api.parse_generate(inputs, CONFIG, tokenizer)


def test_a_request_refused_by_its_parameters_is_not_tokenized(tokenizer):
    before = tokenizer.calls
    with pytest.raises(InvalidRequest, match="max_tokens"):
        api.parse_generate({api.TEXT_INPUT: PROMPT.encode(), api.SAMPLING_PARAMETERS: b'{"max_tokens": 0}'}, CONFIG, tokenizer)
    assert tokenizer.calls == before


def test_without_a_tokenizer_input_ids_are_required():
    with pytest.raises(InvalidRequest, match="input_ids is empty"):
        api.parse_generate({api.TEXT_INPUT: PROMPT.encode()}, CONFIG)


def serve(service, inputs: dict) -> tuple[list[str], list[dict]]:
    """(each response's text, each response's outputs) of one request."""
    sink = Sink(service.tokenizer)
    service.submit("test", api.parse_generate(inputs, service.engine.config, service.tokenizer), sink)
    assert sink.done.wait(120)
    assert "error" not in sink.outputs[-1], sink.outputs[-1]
    return sink.texts, sink.outputs


@pytest.mark.parametrize("mode", ["ar", "dflash", "ddtree"])
def test_text_output_equals_the_ensembles_text(service, tokenizer, mode):
    sampling = json.dumps({"max_tokens": 40, "temperature": 0, "ignore_eos": True, "mode": mode, "tree_budget": 8})
    ids = api.parse_generate({api.TEXT_INPUT: PROMPT.encode()}, CONFIG, tokenizer).prompt_ids
    # the ensemble's route: ids in; what its postprocessing step makes of each response
    ensemble_text, ensemble = serve(service, {api.INPUT_IDS: ids, api.SAMPLING_PARAMETERS: sampling, api.STREAM: True})
    assert all(api.OUTPUT_IDS in o and api.TEXT_OUTPUT not in o for o in ensemble)
    texts, streamed = serve(service, {api.TEXT_INPUT: PROMPT.encode(), api.SAMPLING_PARAMETERS: sampling, api.STREAM: True,
                                      "return_num_output_tokens": True})
    assert all(set(o) == {api.TEXT_OUTPUT, api.NUM_OUTPUT_TOKENS} for o in streamed)   # no ids: nothing after it needs them
    assert texts == ensemble_text and len(streamed) > 2
    assert sum(o[api.NUM_OUTPUT_TOKENS] for o in streamed) == 40
    whole, _ = serve(service, {api.TEXT_INPUT: PROMPT.encode(), api.SAMPLING_PARAMETERS: sampling})
    assert whole == [PROMPT + "".join(ensemble_text)]   # echoed
    local = service.engine.generate_ids(ids, api.parse_generate({api.INPUT_IDS: ids, api.SAMPLING_PARAMETERS: sampling},
                                                               service.engine.config).params).output_ids
    assert "".join(ensemble_text) == decode(tokenizer, local)


def test_text_output_ends_before_a_stop_string(service, tokenizer):
    sampling = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "mode": "ddtree", "tree_budget": 8}
    free = "".join(serve(service, {api.MESSAGES: json.dumps(MESSAGES).encode(), api.SAMPLING_PARAMETERS: json.dumps(sampling),
                                   api.STREAM: True})[0])
    start = next(i for i in range(len(free) // 2, len(free) - 3) if free.find(free[i : i + 3]) == i and free[i : i + 3].strip())
    sampling["stop"] = [free[start : start + 3]]
    texts, stopped = serve(service, {api.MESSAGES: json.dumps(MESSAGES).encode(), api.SAMPLING_PARAMETERS: json.dumps(sampling),
                                     api.STREAM: True, "return_finish_reason": True})
    assert "".join(texts) == free[:start]
    assert stopped[-1][api.FINISH_REASON] == "stop"
