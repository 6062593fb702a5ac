"""Tree build equals a brute-force reading of the best-first rule; compiled masks are ancestor sets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ddtree.tree import build_chain, build_tree, compile_tree, top_log_probs


def reference_tree(log_probs: np.ndarray, token_ids: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """All rank paths sorted by (-sum of log-probs, rank tuple); the first `budget` ones."""
    depth_limit, k = log_probs.shape
    paths = []
    for depth in range(1, depth_limit + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            paths.append((-sum(float(log_probs[d, r]) for d, r in enumerate(ranks)), ranks))
    paths.sort()
    return [ranks for _, ranks in paths[:budget]]


def rank_paths(tree, token_ids: np.ndarray) -> list[tuple[int, ...]]:
    paths = [()]
    for node in range(1, tree.num_nodes + 1):
        depth = tree.depths[node]
        rank = int(np.nonzero(token_ids[depth - 1] == tree.tokens[node])[0][0])
        paths.append(paths[tree.parents[node]] + (rank,))
    return paths[1:]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_build_tree_matches_brute_force(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    depth_limit, vocab = 4, 7
    logits = torch.randn(depth_limit, vocab, generator=gen, dtype=torch.float64) * (1 + seed % 3)
    log_probs, token_ids = top_log_probs(logits, budget)
    tree = build_tree(log_probs, token_ids, budget)
    k = log_probs.shape[1]
    expected = reference_tree(log_probs, token_ids, budget)
    assert rank_paths(tree, token_ids) == expected, f"seed {seed} budget {budget} k {k}"
    assert tree.num_nodes == min(budget, sum(k**d for d in range(1, depth_limit + 1)))



@pytest.mark.parametrize("seed", range(8))
def test_ties_break_on_the_rank_tuples(seed):
    """Paths of equal weight (log-probabilities of a few integer values: their sums are exact) come in the
    lexicographic order of their rank tuples, a prefix before its extensions, as in the brute-force reading."""
    rng = np.random.default_rng(seed)
    depth_limit, k = 4, 3 + seed % 3
    log_probs = -np.sort(rng.integers(1, 3, size=(depth_limit, k)), axis=1).astype(np.float64)
    if seed % 2:
        log_probs[:] = -1.0   # every path of a depth ties
    token_ids = np.arange(depth_limit * k).reshape(depth_limit, k)
    for budget in (5, 17, 40):
        tree = build_tree(log_probs, token_ids, budget)
        assert rank_paths(tree, token_ids) == reference_tree(log_probs, token_ids, budget), (seed, budget)

@pytest.mark.parametrize("seed", range(5))
def test_tree_invariants_and_compiled_mask(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    log_probs, token_ids = top_log_probs(torch.randn(15, 50, generator=gen), 64)
    tree = build_tree(log_probs, token_ids, 64)
    assert tree.num_nodes == 64
    for node in range(1, tree.num_nodes + 1):
        parent = tree.parents[node]
        assert parent < node, f"node {node} precedes parent {parent}"
        assert tree.depths[node] == tree.depths[parent] + 1
        assert tree.children[parent][tree.tokens[node]] == node
    batch = compile_tree(tree, root_token=7, start=100)
    assert batch.input_ids[0] == 7
    assert batch.positions.tolist() == [100 + d for d in tree.depths]
    for node in range(tree.num_nodes + 1):
        ancestors, cur = {node}, node
        while cur > 0:
            cur = tree.parents[cur]
            ancestors.add(cur)
        assert set(torch.nonzero(batch.visibility[node]).flatten().tolist()) == ancestors, f"node {node}"


def test_chain_and_empty():
    chain = build_chain([5, 6, 7])
    assert chain.parents == [-1, 0, 1, 2] and chain.depths == [0, 1, 2, 3]
    log_probs, token_ids = top_log_probs(torch.randn(3, 5), 4)
    assert build_tree(log_probs, token_ids, 0).num_nodes == 0
