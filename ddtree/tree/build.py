"""build_tree(draft log-probs, budget) -> DraftTree, DDTree's best-first rule."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class DraftTree:
    """Nodes 1..num_nodes in pop order (node 0 is the root, which holds no draft token)."""
    tokens: list[int]                 # [num_nodes + 1]; tokens[0] is a placeholder for the root
    parents: list[int]                # [num_nodes + 1]; parents[0] = -1, parents[i] < i
    depths: list[int]                 # [num_nodes + 1]; depths[0] = 0
    children: list[dict[int, int]]    # per node: token -> child node index
    log_weights: list[float]          # [num_nodes + 1]; log of the product of draft marginals on the path

    def truncated(self, budget: int) -> "DraftTree":
        """The first `budget` nodes: in pop order this is the best tree of that budget (prefix-closed)."""
        tree = _empty_tree()
        for i in range(1, min(budget, self.num_nodes) + 1):
            _add_node(tree, self.tokens[i], self.parents[i], self.depths[i], self.log_weights[i])
        return tree

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1


def _empty_tree() -> DraftTree:
    return DraftTree(tokens=[-1], parents=[-1], depths=[0], children=[{}], log_weights=[0.0])


def _add_node(tree: DraftTree, token: int, parent: int, depth: int, log_weight: float = 0.0) -> int:
    index = len(tree.tokens)
    assert parent < index, f"node {index} precedes parent {parent}"
    tree.log_weights.append(log_weight)
    tree.tokens.append(token)
    tree.parents.append(parent)
    tree.depths.append(depth)
    tree.children.append({})
    tree.children[parent][token] = index
    return index


def top_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k log-probabilities and token ids per depth, ranks sorted descending.

    draft_logits  # [..., depth_limit, vocab] -> [..., depth_limit, k] each (one device-to-host copy)
    """
    # one fused log-softmax in float32 (a logsumexp and a subtraction after the top-k were ~10 small kernels, each an
    # eager launch of host time per drafting round)
    log_probs = torch.log_softmax(draft_logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(log_probs, k=min(k, log_probs.shape[-1]), dim=-1)
    # one read for both (a second read is another round trip to the device): ids are exact as float64 (< 2^53)
    both = torch.cat([top.double(), ids.double()], dim=-1).cpu().numpy()
    return both[..., : top.shape[-1]], both[..., top.shape[-1] :].astype(np.int64)


def top_ids(draft_logits: torch.Tensor) -> np.ndarray:
    """The most likely token per depth (a chain's drafts: no log-probabilities needed), read to the host.
    draft_logits  # [..., depth_limit, vocab] -> [..., depth_limit, 1]"""
    return draft_logits.argmax(dim=-1, keepdim=True).cpu().numpy()


def build_tree(log_probs: np.ndarray, token_ids: np.ndarray, budget: int) -> DraftTree:
    """The `budget` prefixes of highest draft probability, popped best-first.

    log_probs, token_ids  # [depth_limit, k], ranks sorted descending per depth.
    A path's weight is the product of its per-depth draft marginals; ties break on the
    lexicographic rank tuple, as in the reference implementation.
    """
    tree = _empty_tree()
    depth_limit, k = log_probs.shape
    if budget <= 0 or depth_limit == 0 or k == 0:
        return tree
    # Python lists: indexing them is several times cheaper than numpy scalars, and this runs per node every round
    log_p, ids = np.asarray(log_probs, dtype=np.float64).tolist(), np.asarray(token_ids).tolist()
    # a prefix's rank tuple (r_1 .. r_d) as one integer, sum (r_i + 1) * base^(depth_limit - i): its order is the
    # tuples' lexicographic order (a proper prefix first), so ties break as on the tuples, without building one per push
    base = k + 1
    place = [base ** (depth_limit - d) for d in range(depth_limit + 1)]   # place[d]: the digit of depth d
    tokens, parents, depths, children, weights = tree.tokens, tree.parents, tree.depths, tree.children, tree.log_weights
    push, pop = heapq.heappush, heapq.heappop
    first = log_p[0][0]
    heap = [(-first, place[1], 0, 1, 0)]  # (-log w, ranks' code, parent, depth, rank)
    while heap and len(tokens) <= budget:
        neg_w, code, parent, depth, rank = pop(heap)
        log_w = -neg_w   # exact
        row = log_p[depth - 1]
        node, token = len(tokens), ids[depth - 1][rank]
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        weights.append(log_w)
        children.append({})
        children[parent][token] = node
        if rank + 1 < k:
            sibling_w = log_w - row[rank] + row[rank + 1]
            push(heap, (-sibling_w, code + place[depth], parent, depth, rank + 1))
        if depth < depth_limit:
            child_w = log_w + log_p[depth][0]
            push(heap, (-child_w, code + place[depth + 1], node, depth + 1, 0))
    return tree


def build_chain(token_ids: list[int]) -> DraftTree:
    """A linear chain (linear DFlash): node d holds the depth-d draft token."""
    tree = _empty_tree()
    for depth, token in enumerate(token_ids, start=1):
        _add_node(tree, int(token), depth - 1, depth)
    return tree
