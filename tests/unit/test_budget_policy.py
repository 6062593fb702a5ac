"""Budget policy: the chosen node counts maximise expected tokens per ms; `auto` stays exact."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ddtree.budget import CostModel, choose_budgets, expected_tokens
from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams
from ddtree.tree import build_tree, top_log_probs

FLAT = CostModel(rows=(1, 4096), verify_ms=(10.0, 10.0), draft_ms=0.0)     # trees are free
STEEP = CostModel(rows=(1, 2, 3, 4096), verify_ms=(10.0, 10.0, 100.0, 1e5), draft_ms=5.0)   # extra rows cost 10x


def brute_force(weights, cost, caps):
    best_rate = -1.0
    for budgets in itertools.product(*[range(c + 1) for c in caps]):
        rows = len(weights) + sum(budgets)
        draft = cost.draft_ms if sum(budgets) else 0.0
        rate = sum(expected_tokens(w, b) for w, b in zip(weights, budgets)) / (draft + cost.verify(rows))
        best_rate = max(best_rate, rate)
    return best_rate


@pytest.mark.parametrize("seed", range(8))
def test_choice_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    weights = [np.sort(rng.random(4) ** 3)[::-1] for _ in range(3)]
    cost = CostModel(rows=(1, 4, 8, 16), verify_ms=tuple(sorted(rng.random(4) * 10 + 1)), draft_ms=float(rng.random()))
    budgets = choose_budgets(weights, cost, [4, 4, 4])
    draft = cost.draft_ms if sum(budgets) else 0.0
    rate = sum(expected_tokens(w, b) for w, b in zip(weights, budgets)) / (draft + cost.verify(3 + sum(budgets)))
    assert rate == pytest.approx(brute_force(weights, cost, [4, 4, 4]), rel=1e-9), f"seed {seed} budgets {budgets}"


def test_trees_pay_only_when_cheap():
    weights = [np.array([0.9, 0.8, 0.5, 0.1]), np.array([0.3, 0.2])]
    assert choose_budgets(weights, FLAT, [4, 2]) == [4, 2]        # free nodes: take them all
    assert choose_budgets(weights, STEEP, [4, 2]) == [0, 0]       # expensive: plain decoding


def test_truncated_tree_is_the_smaller_best_first_tree():
    rng = np.random.default_rng(0)
    log_probs, token_ids = top_log_probs(__import__("torch").tensor(rng.normal(size=(6, 30))), 40)
    full = build_tree(log_probs, token_ids, 40)
    for budget in (0, 1, 7, 20, 40):
        small = build_tree(log_probs, token_ids, budget)
        cut = full.truncated(budget)
        assert (cut.tokens, cut.parents, cut.depths) == (small.tokens, small.parents, small.depths)


@pytest.mark.parametrize("cost", [FLAT, STEEP], ids=["flat", "steep"])
def test_auto_mode_is_exact(tiny_models, tmp_path, cost):
    path = tmp_path / "cost.json"
    path.write_text(__import__("json").dumps({"rows": list(cost.rows), "verify_ms": list(cost.verify_ms),
                                              "draft_ms": cost.draft_ms}))
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=128,
                                 max_tree_budget=64, cost_model_path=str(path)))
    prompt = [5, 6, 7, 8, 9]
    params = dict(max_tokens=30, ignore_eos=True)
    ar = engine.generate_ids(prompt, SamplingParams(mode="ar", **params)).output_ids
    auto = engine.generate_ids(prompt, SamplingParams(mode="auto", tree_budget=32, **params))
    assert auto.output_ids == ar
    nodes = engine.stage_times.tree_nodes
    assert (nodes > 0) if cost is FLAT else (nodes == 0), f"{nodes} tree nodes verified"
    if cost is STEEP:   # trees never pay: after back-off the drafter runs in few of the ~30 rounds
        assert engine.stage_times.draft_passes <= 8, engine.stage_times.draft_passes
