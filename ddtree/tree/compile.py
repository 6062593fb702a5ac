"""compile_tree(tree, root token, start) -> VerifyBatch: ids, positions and ancestor mask."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ddtree.tree.build import DraftTree


@dataclass(slots=True)
class VerifyBatch:
    input_ids: torch.Tensor   # [num_nodes + 1] long; row 0 is the root
    positions: torch.Tensor   # [num_nodes + 1] long; root position + depth (siblings share)
    mask: torch.Tensor | None = None      # the visibility, given or built on first use
    tree: DraftTree | None = None

    @property
    def visibility(self) -> torch.Tensor:
        """[num_nodes + 1, num_nodes + 1] bool; ancestors and self. Built from the tree on first use: a static forward
        derives it on the device from the parents and never asks (host work saved every round)."""
        if self.mask is None:
            self.mask = ancestor_matrix(self.tree.parents, self.tree.depths)
        return self.mask


def ancestor_matrix(parents: list[int], depths: list[int]) -> torch.Tensor:
    """visibility[i, j] = node j is node i or one of its ancestors.

    One vectorised copy per depth level (a node's row is its parent's row plus itself), so the cost is
    O(depth) array operations rather than O(nodes).
    """
    n = len(parents)
    par, depth = np.asarray(parents, dtype=np.int64), np.asarray(depths, dtype=np.int64)
    visibility = np.zeros((n, n), dtype=bool)
    visibility[0, 0] = True
    for d in range(1, int(depth.max(initial=0)) + 1):
        nodes = np.flatnonzero(depth == d)
        visibility[nodes] = visibility[par[nodes]]
        visibility[nodes, nodes] = True
    return torch.from_numpy(visibility)


def compile_tree(tree: DraftTree, root_token: int, start: int) -> VerifyBatch:
    tokens = [root_token] + tree.tokens[1:]
    depths = torch.tensor(tree.depths, dtype=torch.long)
    return VerifyBatch(input_ids=torch.tensor(tokens, dtype=torch.long), positions=depths + start, tree=tree)
