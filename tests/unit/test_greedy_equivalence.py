"""At temperature 0, every decoding mode emits exactly the target's own greedy tokens (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams
from tests.unit.oracle import OracleDraftEngine

PROMPTS = [
    [{"role": "user", "content": "Write a function that adds two numbers."}],
    [{"role": "user", "content": "日本語で挨拶してください 🚀"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about trees."}],
]
MAX_TOKENS = 40


def config_for(tiny_models, family: str) -> EngineConfig:
    return EngineConfig(target_path=str(tiny_models / f"{family}-target"),
                        drafter_path=str(tiny_models / f"{family}-dflash"), max_model_len=256,
                        max_tree_budget=64)


def prompt_ids(tiny_models, family: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / f"{family}-target")
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for m in PROMPTS]


def greedy(mode: str, budget: int = 16) -> SamplingParams:
    # ignore_eos keeps every run at MAX_TOKENS so the comparison spans many rounds
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, mode=mode, tree_budget=budget, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request, tiny_models):
    family = request.param
    reference = AutoModelForCausalLM.from_pretrained(tiny_models / f"{family}-target", dtype=torch.float32).eval()
    config = config_for(tiny_models, family)
    engine = OracleDraftEngine(config, reference=reference)
    return family, engine, reference, prompt_ids(tiny_models, family)


def test_ar_equals_transformers_greedy(setup):
    family, engine, reference, prompts = setup
    for i, ids in enumerate(prompts):
        ours = engine.generate_ids(ids, greedy("ar")).output_ids
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        assert ours == out[0, len(ids):].tolist(), f"{family} prompt {i}"


@pytest.mark.parametrize("mode,budget", [("dflash", 0), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)])
def test_speculative_greedy_equals_ar(setup, mode, budget):
    family, engine, _, prompts = setup
    lengths = []
    for i, ids in enumerate(prompts):
        expected = engine.generate_ids(ids, greedy("ar")).output_ids
        request = engine.generate_ids(ids, greedy(mode, max(budget, 1)))
        assert request.output_ids == expected, f"{family} mode {mode} budget {budget} prompt {i}"
        lengths.append(request.mean_acceptance_length)
    # the oracle drafter makes rounds accept several tokens, so the walk and compaction really ran
    assert max(lengths) > 1.5, f"{family} {mode} {budget}: acceptance {lengths}"


def test_random_drafter_is_exact_too(tiny_models):
    """The shipped random drafter (no oracle) through the plain engine: same tokens as ar."""
    engine = Engine(config_for(tiny_models, "qwen3"))
    for ids in prompt_ids(tiny_models, "qwen3"):
        expected = engine.generate_ids(ids, greedy("ar")).output_ids
        for mode, budget in [("dflash", 1), ("ddtree", 32)]:
            assert engine.generate_ids(ids, greedy(mode, budget)).output_ids == expected, mode
