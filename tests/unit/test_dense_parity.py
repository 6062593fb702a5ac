"""The serving forward matches transformers' reference logits (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ddtree.models.dense import DenseTarget
from ddtree.tree import build_tree, compile_tree, top_log_probs


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prefill_logits_match_transformers(tiny_models, family):
    path = tiny_models / f"{family}-target"
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = DenseTarget.from_pretrained(path)
    ids = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None], output_hidden_states=True)
        cache = model.new_cache(64)
        causal = torch.ones(37, 37, dtype=torch.bool).tril()
        logits, taps = model(ids, torch.arange(37), cache, 0, causal, tap_layers=[0, 2])
    torch.testing.assert_close(logits, expected.logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(taps[:, :64], expected.hidden_states[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(taps[:, 64:], expected.hidden_states[3][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tree_verify_equals_per_branch_causal_forward(tiny_models, family):
    """Each tree node's logits equal a plain causal forward over its own ancestors."""
    path = tiny_models / f"{family}-target"
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = DenseTarget.from_pretrained(path)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, model.config.vocab_size, (11,), generator=gen)
    log_probs, token_ids = top_log_probs(torch.randn(5, model.config.vocab_size, generator=gen), 12)
    tree = build_tree(log_probs, token_ids, 12)
    batch = compile_tree(tree, root_token=int(prefix[-1]), start=10)
    with torch.no_grad():
        cache = model.new_cache(64)
        model(prefix[:10], torch.arange(10), cache, 0, torch.ones(10, 10, dtype=torch.bool).tril())
        logits, _ = model(batch.input_ids, batch.positions, cache, 10, batch.visibility)
        for node in range(tree.num_nodes + 1):
            path_nodes = [i for i in range(node + 1) if batch.visibility[node, i]]
            seq = torch.cat([prefix[:10], batch.input_ids[path_nodes]])
            expected = reference(seq[None]).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, rtol=1e-4, atol=1e-4,
                                       msg=f"{family} node {node} depth {tree.depths[node]}")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_packed_segments_equal_one_at_a_time(tiny_models, family):
    """Three sequences (a prompt, two trees after different prefixes) in one pooled forward, attention in one
    padded call, == each sequence's forward on its own cache."""
    from ddtree.models.dense import Segment

    model = DenseTarget.from_pretrained(tiny_models / f"{family}-target")
    gen = torch.Generator().manual_seed(3)
    prefixes = [0, 17, 6]
    rows = []
    for start in prefixes:
        if start == 0:
            n = 9
            ids, visibility = torch.randint(0, model.config.vocab_size, (n,), generator=gen), torch.ones(n, n).tril().bool()
            rows.append((start, ids, torch.arange(n), visibility, None))
            continue
        prefix = torch.randint(0, model.config.vocab_size, (start,), generator=gen)
        log_probs, token_ids = top_log_probs(torch.randn(4, model.config.vocab_size, generator=gen), 7)
        batch = compile_tree(build_tree(log_probs, token_ids, 7), root_token=int(prefix[-1]), start=start)
        rows.append((start, batch.input_ids, batch.positions, batch.visibility, prefix))
    with torch.no_grad():
        pooled = model.new_caches(len(rows), 64)
        alone = [model.new_cache(64) for _ in rows]
        for (start, _, _, _, prefix), p, a in zip(rows, pooled, alone):
            if prefix is not None:
                causal = torch.ones(start, start).tril().bool()
                model(prefix, torch.arange(start), p, 0, causal)
                model(prefix, torch.arange(start), a, 0, causal)
        segments = [Segment.of(c, start, vis) for c, (start, _, _, vis, _) in zip(pooled, rows)]
        logits, _ = model.forward_packed(torch.cat([r[1] for r in rows]), torch.cat([r[2] for r in rows]), segments)
        offset = 0
        for (start, ids, positions, vis, _), cache in zip(rows, alone):
            expected, _ = model(ids, positions, cache, start, vis)
            torch.testing.assert_close(logits[offset : offset + len(ids)], expected, rtol=1e-5, atol=1e-5)
            offset += len(ids)
