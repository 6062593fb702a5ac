"""Request parsing: every bad input is an InvalidRequest naming the field and the allowed range."""

from __future__ import annotations

import json

import pytest

from ddtree import api
from ddtree.config import EngineConfig
from ddtree.errors import InvalidRequest

CONFIG = EngineConfig(target_path="t", drafter_path="d", max_tokens_limit=512, max_tree_budget=64)


def generate(**inputs):
    inputs.setdefault(api.INPUT_IDS, [1, 2, 3])
    return api.parse_generate(inputs, CONFIG)


def sampling(**values):
    return generate(sampling_parameters=json.dumps(values).encode())


def test_defaults_and_overrides():
    request = sampling(max_tokens="32", temperature=0.5, top_p=0.9, top_k=20, seed=7, mode="dflash")
    p = request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.mode) == (32, 0.5, 0.9, 20, 7, "dflash")
    default = generate().params
    assert default.mode == "ddtree" and default.tree_budget == CONFIG.default_tree_budget
    assert generate().echo_text == ""             # non-streaming echoes the (absent) text by default
    assert generate(stream=True).echo_text is None
    assert sampling(tree_budget=64).params.tree_budget == 64


@pytest.mark.parametrize("values,match", [
    (dict(max_tokens=0), r"max_tokens must be in \[1, 512\], got 0"),
    (dict(max_tokens=513), r"max_tokens must be in \[1, 512\], got 513"),
    (dict(max_tokens="ten"), "max_tokens must be int"),
    (dict(temperature=-1), "temperature must be in"),
    (dict(temperature="nan"), "temperature must be finite"),
    (dict(top_p=0), "top_p must be in"),
    (dict(top_k=-3), "top_k must be"),
    (dict(mode="beam"), "mode must be one of"),
    (dict(tree_budget=0), r"tree_budget must be in \[1, 64\], got 0"),
    (dict(tree_budget=65), r"tree_budget must be in \[1, 64\], got 65"),
    (dict(frobnicate=1), "unknown key 'frobnicate'"),
    (dict(n=2), "n=2 is not supported"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(stop_token_ids="2"), "stop_token_ids must be a list"),
    (dict(stop=["x"] * 17), "stop has 17 strings; at most 16"),
    (dict(stop=["ok", ""]), "stop strings must have 1 to 256 characters, got 0"),
])
def test_bad_sampling_parameters(values, match):
    with pytest.raises(InvalidRequest, match=match):
        sampling(**values)


@pytest.mark.parametrize("raw,match", [
    (b"{not json", "sampling_parameters is not valid JSON"),
    (b"[1, 2]", "sampling_parameters must be a JSON dict"),
    (b"\xff\xfe", "sampling_parameters is not valid UTF-8"),
])
def test_malformed_sampling_json(raw, match):
    with pytest.raises(InvalidRequest, match=match):
        generate(sampling_parameters=raw)


def test_stream_with_echo_is_rejected():
    with pytest.raises(InvalidRequest, match="exclude_input_in_output=false is not allowed"):
        generate(stream=True, exclude_input_in_output=False)


def test_prompt_parsing():
    assert api.parse_prompt(b"hello").text == "hello"
    prompt = api.parse_prompt(b"", b'[{"role": "user", "content": "hi"}]', b'{"enable_thinking": false}')
    assert prompt.messages == [{"role": "user", "content": "hi"}]
    assert prompt.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(InvalidRequest, match="text_input is empty"):
        api.parse_prompt(b"")
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        api.parse_prompt(b"caf\xc3")
    with pytest.raises(InvalidRequest, match="messages must not be empty"):
        api.parse_prompt(b"", b"[]")
    with pytest.raises(InvalidRequest, match=r"messages\[0\] must be an object"):
        api.parse_prompt(b"", b'[{"role": "user"}]')
    with pytest.raises(InvalidRequest, match="chat_template_kwargs must be a JSON dict"):
        api.parse_prompt(b"x", None, b"[]")


def test_engine_config_rejects_unknown_and_bad_values():
    with pytest.raises(ValueError, match="unknown engine parameter"):
        EngineConfig.from_dict({"target_path": "t", "tree_budegt": "3"})
    with pytest.raises(ValueError, match="default_mode"):
        EngineConfig.from_dict({"target_path": "t", "default_mode": "beam"})
    with pytest.raises(ValueError, match="needs drafter_path"):
        EngineConfig.from_dict({"target_path": "t"})
    config = EngineConfig.from_dict({"target_path": "t", "default_mode": "ar", "max_model_len": "99"}, base_dir="/x")
    assert config.max_model_len == 99 and config.target_path == "/x/t"
