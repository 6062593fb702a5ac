"""The tiny Qwen3.6-vocabulary hybrid (scripts/make_tiny_hybrid.py) served by a real tritonserver.

Same model repository as the default deployment; only config parameters change (target_path,
drafter_path, tokenizer_path, max_tree_budget). Preprocessing renders the Qwen3-style chat template
with enable_thinking through the real 248,077-token vocabulary, as with the real model.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from client.chat import build_inputs, stream_chat
from ddtree.tokenizer import Tokenizer
from scripts import make_tiny_hybrid
from tests.server.conftest import set_parameter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from triton_env import TritonServer  # noqa: E402

PREBUILT = ROOT / "models" / "qwen36-tiny"   # `python scripts/make_tiny_hybrid.py --out models/qwen36-tiny`
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about speculative decoding, then translate it to 中文 🌸."}]
NO_THINKING = {"enable_thinking": False}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory) -> Path:
    if make_tiny_hybrid.is_complete(PREBUILT):
        return PREBUILT
    out = tmp_path_factory.mktemp("qwen36-tiny")
    make_tiny_hybrid.make_all(out)
    return out


@pytest.fixture(scope="module")
def target_path(tiny_hybrid) -> Path:
    return tiny_hybrid / make_tiny_hybrid.TARGET_NAME


@pytest.fixture(scope="module", params=["auto", "on"])
def hybrid_server(request, tiny_hybrid, target_path, tmp_path_factory):
    """static_forward auto (the dynamic forward on the CPU) and on (the static forward a CUDA graph captures, run
    eagerly): the same greedy text either way."""
    repo = tmp_path_factory.mktemp("hybrid-server") / "model_repository"
    shutil.copytree(ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    for model in ("preprocessing", "postprocessing"):
        set_parameter(repo / model / "config.pbtxt", "tokenizer_path", str(target_path))
    config = repo / "ddtree" / "config.pbtxt"
    set_parameter(config, "target_path", str(target_path))
    set_parameter(config, "drafter_path", str(tiny_hybrid / make_tiny_hybrid.DRAFTER_NAME))
    set_parameter(config, "max_tree_budget", "64")
    set_parameter(config, "static_forward", request.param)
    log = tmp_path_factory.mktemp("hybrid-server-log") / "tritonserver.log"
    with TritonServer(str(repo), log_path=str(log)) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(target_path) -> Tokenizer:
    return Tokenizer(target_path)


def run(server, sampling: dict, stream: bool, chat_template_kwargs: dict | None = NO_THINKING):
    """(text of every response, outputs of every response) of one ensemble request."""
    texts, outputs = [], []
    inputs = build_inputs(CHAT, sampling, stream=stream, chat_template_kwargs=chat_template_kwargs)
    for text, out in stream_chat(server.grpc_url, "ensemble", inputs, timeout_s=300):
        texts.append(text)
        outputs.append(out)
    return texts, outputs


def values(outputs: list[dict], name: str) -> list:
    return [out[name][0] for out in outputs if out.get(name)]


def test_greedy_ddtree_stream_equals_ar_stream_equals_nonstreamed(hybrid_server, tokenizer):
    prompt_ids = tokenizer.apply_chat_template(CHAT, enable_thinking=False)
    assert tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    ddtree = {**greedy, "mode": "ddtree", "tree_budget": 16}
    tree_pieces, tree_outputs = run(hybrid_server, ddtree, stream=True)
    ar_pieces, ar_outputs = run(hybrid_server, {**greedy, "mode": "ar"}, stream=True)
    whole, whole_outputs = run(hybrid_server, ddtree, stream=False)

    assert len(whole) == 1
    assert "".join(tree_pieces) == "".join(ar_pieces) == whole[0]
    assert whole[0], "24 greedy tokens should decode to some text"
    assert len(tree_pieces) > 2 and len(ar_pieces) > 2, "the streams should arrive in several responses"
    for outputs in (tree_outputs, ar_outputs, whole_outputs):
        assert values(outputs, "num_input_tokens") and set(values(outputs, "num_input_tokens")) == {len(prompt_ids)}
        assert sum(values(outputs, "num_output_tokens")) == MAX_TOKENS
        assert values(outputs, "finish_reason")[-1] == b"length"
    # the tiny target's lm_head favours a few tokens, so the random drafter's tree does get accepted
    assert values(tree_outputs, "mean_acceptance_length")[-1] > 1.0


def test_chat_template_kwargs_reach_the_template(hybrid_server, tokenizer):
    """enable_thinking true / absent opens a thinking block: 2 prompt tokens fewer than an empty one."""
    sampling = {"max_tokens": 2, "temperature": 0, "ignore_eos": True, "mode": "ar"}
    lengths = {}
    for name, kwargs in (("off", NO_THINKING), ("on", {"enable_thinking": True}), ("default", None)):
        _, outputs = run(hybrid_server, sampling, stream=False, chat_template_kwargs=kwargs)
        lengths[name] = values(outputs, "num_input_tokens")[-1]
        assert lengths[name] == len(tokenizer.apply_chat_template(CHAT, **(kwargs or {})))
    assert lengths["on"] == lengths["default"] == lengths["off"] - 2
