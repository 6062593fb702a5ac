"""compile_tree(tree, root token, start) -> VerifyBatch: ids, positions and ancestor mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree.build import DraftTree


@dataclass(slots=True)
class VerifyBatch:
    input_ids: torch.Tensor   # [num_nodes + 1] long; row 0 is the root
    positions: torch.Tensor   # [num_nodes + 1] long; root position + depth (siblings share)
    visibility: torch.Tensor  # [num_nodes + 1, num_nodes + 1] bool; ancestors and self


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """visibility[i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    visibility = torch.zeros((n, n), dtype=torch.bool)
    visibility[0, 0] = True
    for i in range(1, n):
        visibility[i, :i] = visibility[parents[i], :i]
        visibility[i, i] = True
    return visibility


def compile_tree(tree: DraftTree, root_token: int, start: int) -> VerifyBatch:
    tokens = [root_token] + tree.tokens[1:]
    depths = torch.tensor(tree.depths, dtype=torch.long)
    return VerifyBatch(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=depths + start,
        visibility=ancestor_matrix(tree.parents),
    )
