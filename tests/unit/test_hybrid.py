"""Qwen3.5/3.6 hybrid target: parity with transformers, exact tree verification, greedy ddtree == ar."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.config import EngineConfig
from ddtree.models.qwen3_5 import HybridTarget
from ddtree.sampling_params import SamplingParams
from ddtree.tree import build_tree, compile_tree, top_log_probs
from tests.unit.oracle import VOCAB, OracleDraftEngine, make_tiny_hybrid


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("hybrid"))


def test_prefill_logits_match_transformers(hybrid):
    root, reference = hybrid
    model = HybridTarget.from_pretrained(root / "target")
    ids = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None], output_hidden_states=True)
        logits, taps = model(ids, torch.arange(29), model.new_cache(64), 0, torch.ones(29, 29, dtype=torch.bool).tril(),
                             tap_layers=[1, 2])
    torch.testing.assert_close(logits, expected.logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(taps[:, 64:], expected.hidden_states[3][0], rtol=1e-4, atol=1e-4)


def test_long_prompt_prefill_in_chunks_matches_transformers(hybrid):
    """A prompt longer than PREFILL_CHUNK goes through the GDN core in pieces; logits and the state
    committed after it (checked through the next token's logits) match transformers."""
    from ddtree.models.qwen3_5 import PREFILL_CHUNK

    root, reference = hybrid
    model = HybridTarget.from_pretrained(root / "target")
    n = 2 * PREFILL_CHUNK + 37
    ids = torch.randint(0, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        cache = model.new_cache(n + 8)
        logits, _ = model(ids[:n], torch.arange(n), cache, 0, torch.ones(n, n, dtype=torch.bool).tril())
        cache.compact(0, list(range(n)))
        step, _ = model(ids[n:], torch.tensor([n]), cache, n, torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(logits, expected[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[0], expected[n], rtol=1e-4, atol=1e-4)


def test_published_multimodal_layout_loads(hybrid, tmp_path):
    """Qwen3_5ForConditionalGeneration keys (model.language_model.*) with mtp.* and vision weights ignored."""
    root, reference = hybrid
    state = load_file(str(root / "target" / "model.safetensors"))
    renamed = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
               for k, v in state.items()}
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    renamed["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    text = json.loads((root / "target" / "config.json").read_text())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = HybridTarget.from_pretrained(tmp_path)
    ids = torch.arange(5, 17)
    with torch.no_grad():
        logits, _ = model(ids, torch.arange(12), model.new_cache(32), 0, torch.ones(12, 12, dtype=torch.bool).tril())
        torch.testing.assert_close(logits, reference(ids[None]).logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_tree_nodes_equal_causal_forward_over_ancestors(hybrid, seed):
    """Every node of a verified tree (GDN state, conv window, attention) == a plain forward of its root path."""
    root, reference = hybrid
    model = HybridTarget.from_pretrained(root / "target")
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (13,), generator=gen)
    log_probs, token_ids = top_log_probs(torch.randn(6, VOCAB, generator=gen), 24)
    tree = build_tree(log_probs, token_ids, 24)
    batch = compile_tree(tree, root_token=int(prefix[-1]), start=12)
    with torch.no_grad():
        cache = model.new_cache(64)
        model(prefix[:12], torch.arange(12), cache, 0, torch.ones(12, 12, dtype=torch.bool).tril())
        cache.compact(0, list(range(12)))
        logits, _ = model(batch.input_ids, batch.positions, cache, 12, batch.visibility)
        for node in range(tree.num_nodes + 1):
            path = [i for i in range(node + 1) if batch.visibility[node, i]]
            expected = reference(torch.cat([prefix[:12], batch.input_ids[path]])[None]).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, rtol=1e-4, atol=1e-4,
                                       msg=f"seed {seed} node {node} depth {tree.depths[node]}")


@pytest.fixture(scope="module")
def engine(hybrid):
    root, reference = hybrid
    config = EngineConfig(target_path=str(root / "target"), drafter_path=str(root / "dflash"), max_model_len=320,
                          max_tree_budget=64)
    return OracleDraftEngine(config, reference=reference)


@pytest.mark.parametrize("mode,budget", [("dflash", 1), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)])
def test_greedy_speculative_equals_ar_on_hybrid(engine, mode, budget):
    for i, prompt in enumerate([[3, 4, 5, 6, 7], list(range(10, 40))]):
        params = dict(max_tokens=40, ignore_eos=True)
        expected = engine.generate_ids(prompt, SamplingParams(mode="ar", **params)).output_ids
        request = engine.generate_ids(prompt, SamplingParams(mode=mode, tree_budget=budget, **params))
        assert request.output_ids == expected, f"mode {mode} budget {budget} prompt {i}"
        assert request.mean_acceptance_length > 1.3, f"mode {mode} budget {budget}: the walk never accepted"


def test_long_generation_commits_state_many_times(engine, hybrid):
    """200 tokens: the recurrent state is committed ~100 times; ar == ddtree == transformers greedy."""
    _, reference = hybrid
    prompt = [5, 9, 2, 7]
    params = dict(max_tokens=200, ignore_eos=True)
    ar = engine.generate_ids(prompt, SamplingParams(mode="ar", **params)).output_ids
    tree = engine.generate_ids(prompt, SamplingParams(mode="ddtree", tree_budget=16, **params))
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=200, do_sample=False, eos_token_id=None)
    assert ar == out[0, len(prompt):].tolist()
    assert tree.output_ids == ar and len(tree.acceptance_lengths) < 150
