"""The shipped trained drafter with the embedded default: exact (greedy == ar, fp32 CPU) and really trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams
from ddtree.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "smollm2-135m-instruct"
DRAFTER = ROOT / "models" / "smollm2-135m-instruct-dflash"
PROMPTS = ["Write a Python function `fib(n)` that returns the n-th Fibonacci number.",
           "Explain in two sentences what a hash table is."]


@pytest.fixture(scope="module")
def setup():
    if not (DRAFTER / "model.safetensors.index.json").exists():
        pytest.fail("the shipped trained drafter is not installed: run `make setup`")
    engine = Engine(EngineConfig(target_path=str(TARGET), drafter_path=str(DRAFTER), device="cpu", dtype="float32",
                                 max_tree_budget=64, max_model_len=1024))
    tokenizer = Tokenizer(TARGET)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    return engine, prompts


def run(engine, prompt, mode, budget=1, max_tokens=48):
    params = SamplingParams(max_tokens=max_tokens, mode=mode, tree_budget=budget, temperature=0.0)
    return engine.generate_ids(prompt, params)


def test_greedy_equals_ar_with_the_trained_drafter(setup):
    engine, prompts = setup
    for prompt in prompts:
        reference = run(engine, prompt, "ar").output_ids
        for mode, budget in (("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)):
            assert run(engine, prompt, mode, budget).output_ids == reference, (mode, budget)


def test_trained_drafter_is_accepted(setup):
    """A random drafter gives 1.0 here; the trained one must draft tokens the target accepts."""
    engine, prompts = setup
    dflash = run(engine, prompts[0], "dflash").mean_acceptance_length
    tree = run(engine, prompts[0], "ddtree", 64).mean_acceptance_length
    assert dflash > 1.5 and tree >= dflash, (dflash, tree)
