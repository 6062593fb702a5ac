"""The draft vocabulary (EngineConfig.draft_vocab, ddtree.draft_vocab): the drafter proposes only ids below it and the
EOS ids, its logits are those columns of the full lm_head's, and greedy decoding stays the target's own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from ddtree.config import EngineConfig
from ddtree.draft_vocab import DraftVocab
from ddtree.engine import Engine
from ddtree.sampling_params import SamplingParams


@pytest.mark.parametrize("bias", [False, True])
def test_subset_logits_are_the_full_logits_columns(bias):
    head = nn.Linear(8, 50, bias=bias)
    hidden = torch.randn(2, 3, 8)
    vocab = DraftVocab(50, 20, {45, 3, 20}, torch.device("cpu"))   # 3: already in the prefix
    assert not vocab.full and vocab.width == 22
    columns = list(range(20)) + [20, 45]
    torch.testing.assert_close(vocab.logits(head, hidden), head(hidden)[..., columns])
    assert vocab.token_ids(torch.tensor([0, 19, 20, 21])).tolist() == [0, 19, 20, 45]
    assert vocab.token_ids(np.array([[21, 5]])).tolist() == [[45, 5]]
    for size in (0, 50, 80):
        full = DraftVocab(50, size, {45}, torch.device("cpu"))
        assert full.full and full.width == 50 and full.token_ids(torch.tensor([7])).tolist() == [7]
        torch.testing.assert_close(full.logits(head, hidden), head(hidden))


def test_a_negative_size_is_a_config_error(tiny_models):
    with pytest.raises(ValueError, match="draft_vocab must be >= 0"):
        EngineConfig(target_path=str(tiny_models / "qwen3-target"), default_mode="ar", draft_vocab=-1)


@pytest.mark.parametrize("static", ["off", "on"])
def test_greedy_tokens_are_the_targets_and_every_proposal_is_in_the_subset(tiny_models, static, monkeypatch):
    """dflash and ddtree rounds with a 40-id draft vocabulary (of 320, and an EOS id 300 above it) decode the target's
    greedy tokens; every drafted token is below 40 or the EOS id, where the whole vocabulary's drafter proposes ids above it. static on:
    the CPU runs the static forwards eagerly and builds the trees on the device (the one-read round)."""
    import ddtree.engine as engine_module

    base = dict(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                max_model_len=128, max_tree_budget=32, static_forward=static, device_tree=static == "on")
    prompt = [5, 9, 17, 33, 2, 71, 140, 12]
    expected = Engine(EngineConfig(**base)).generate_ids(prompt, SamplingParams(mode="ar", max_tokens=20,
                                                                                ignore_eos=True)).output_ids
    proposed: list[int] = []
    add_node = engine_module._add_node
    monkeypatch.setattr(engine_module, "_add_node", lambda tree, token, *a: proposed.append(int(token))
                        or add_node(tree, token, *a))
    build_tree, build_chain = engine_module.build_tree, engine_module.build_chain
    monkeypatch.setattr(engine_module, "build_tree", lambda lp, ids, budget: proposed.extend(np.ravel(ids).tolist())
                        or build_tree(lp, ids, budget))
    monkeypatch.setattr(engine_module, "build_chain", lambda ids: proposed.extend(ids) or build_chain(ids))
    from ddtree.models.target import load_target

    seen = {}
    for size in (0, 40):
        config = EngineConfig(**base, draft_vocab=size)
        target = load_target(config.target_path, torch.float32, "cpu")
        # an EOS id above the prefix, kept in the subset
        target.config = dataclasses.replace(target.config, eos_token_ids=(*target.config.eos_token_ids, 300))
        engine = Engine(config, target=target)
        proposed.clear()
        for mode, budget in (("dflash", 1), ("ddtree", 16)):
            params = SamplingParams(mode=mode, tree_budget=budget, max_tokens=20, ignore_eos=True)
            assert engine.generate_ids(prompt, params).output_ids == expected, (size, mode)
        assert proposed, size
        if static == "on":
            assert engine.stage_times.device_trees > 0
        seen[size] = set(proposed)
    assert max(seen[0]) >= 40                                     # the subset binds here
    assert all(t < 40 or t in target.eos_token_ids for t in seen[40]), sorted(seen[40])
    assert 300 in seen[40]   # the kept EOS row, proposed by its id (not its position, 40, in the subset)


def test_the_benchmark_reports_tau_and_the_tokens_outside(tiny_models, tmp_path):
    """perf/draft_vocab.py on tiny checkpoints: per size its tau, the lm_head rows read, the share of the target's
    greedy tokens outside the subset (computed from the texts), and every text the target's."""
    import json

    from perf import draft_vocab

    result = draft_vocab.main(["--target", str(tiny_models / "qwen3-target"), "--drafter",
                               str(tiny_models / "qwen3-dflash"), "--sizes", "0,40", "--budgets", "16",
                               "--num-prompts", "2", "--max-new-tokens", "8", "--out", str(tmp_path), "--name", "v"])
    assert draft_vocab.outside_share([[1, 50], [300, 39]], 40, {300}) == 0.25   # 50; EOS 300 is kept
    whole, subset = result["sizes"]["0"], result["sizes"]["40"]
    assert whole["draft_rows_share"] == 1.0 and whole["target_tokens_outside"] == 0.0
    assert subset["draft_rows"] == 40 and 0 < subset["draft_rows_share"] < 1
    assert set(subset["tau"]) == {"ar", "dflash", "ddtree-16"} and subset["tau"]["ar"] == 1.0
    assert not whole["greedy_mismatches"] and not subset["greedy_mismatches"]
    saved = json.loads((tmp_path / "v.json").read_text())
    assert saved["sizes"]["40"]["target_tokens_outside"] == subset["target_tokens_outside"]
    assert "| 40 | 40 (12%) |" in (tmp_path / "v.md").read_text()


def test_text_shares_count_the_tokens_above_each_size(tiny_models, tmp_path):
    from ddtree.tokenizer import Tokenizer
    from perf import draft_vocab

    path = str(tiny_models / "qwen3-target")
    result = draft_vocab.main(["--shares-only", path, "--sizes", "0,40,100000", "--out", str(tmp_path), "--name", "s"])
    entry = result["shares"][path]
    assert set(entry["share_at_or_above"]) == {"40", "100000"} and entry["vocab"] == len(Tokenizer(path))
    assert 0 < entry["share_at_or_above"]["40"] < 1 and entry["share_at_or_above"]["100000"] == 0.0
    assert entry["tokens"] > 1000 and "| qwen3-target |" in (tmp_path / "s.md").read_text()
