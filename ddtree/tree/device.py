"""The draft tree and the verify's tree inputs built on the device, with static shapes and no host reads.

build_tree (tree/build.py) pops prefixes best-first on the host, after reading the draft's top-k log-probabilities.
Here the same tree comes from a few tensor operations, so that a round can queue the draft, the tree build and the
verify back to back and read the device once (the verify's choices with the tree that produced them):

- per depth, the `budget` best prefixes of that depth are among the extensions of the previous depth's `budget`
  best (a prefix whose parent is not among them has `budget` better prefixes: the better parents extended by the
  same rank), and among those, the i-th best parent (from 1) extended by its r-th rank only where i * r <= budget
  (the i' <= i, r' <= r extensions are at least as good): about budget x ln(budget) candidates (280 of 64 x 64 at
  budget 64), sorted once per depth (a sort of a few hundred is a single block's work; a top-k over all budget x k
  took 57 us a depth on the H200, most of the tree's cost);
- the tree is the `budget` best prefixes over all depths. Since a log-probability is <= 0, a child never beats its
  parent; a stable sort by score, descending, of the depths' candidates laid out depth after depth puts every
  parent before its children (ties go to the shallower prefix), which is the pop order of build_tree.

Path weights are float32 sums (a 64-bit key doubles a radix sort's passes: 28 us a depth on the H200 with float64);
build_tree sums in float64, so the two trees may differ where two prefixes' weights are within float32 rounding of
each other (and on exact ties, which build_tree orders by rank tuples). Any tree is lossless: the verify decides
what is accepted.
"""

from __future__ import annotations

import torch


def fits_budget(depth: int, k: int, budget: int) -> int:
    """How many nodes a tree of `budget` reaches with `depth` levels of `k` ranks (fewer where there are fewer prefixes)."""
    total, level = 0, 1
    for _ in range(depth):
        level = min(level * k, budget)
        total += level
    return min(total, budget)


def candidate_grid(width: int, k: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent slot, rank) of the extensions that can be among a depth's `width` best: slot i (0-based, previous
    depth's prefixes best first) by rank r (ranks best first) where (i + 1) * (r + 1) <= width, r < k. Built on the
    host (a static program makes it before its capture)."""
    pairs = [(i, r) for i in range(width) for r in range(min(k, width // (i + 1)))]
    return (torch.tensor([i for i, _ in pairs], dtype=torch.long, device=device),
            torch.tensor([r for _, r in pairs], dtype=torch.long, device=device))


def build_tree_device(log_probs: torch.Tensor, token_ids: torch.Tensor, width: int,
                      grid: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents, depths) of the `width` best prefixes in best-first order, nodes 1..width; parents index nodes
    (0 = the root). log_probs, token_ids  # [depth, k], ranks sorted descending per depth (-inf: no such rank)
    -> [width] each. A tree of budget b <= width is the first fits_budget(depth, k, b) of them, ranks beyond b at
    -inf: each depth's best `width` prefixes hold its best b, so one program serves every budget up to its width.
    Past the prefixes there are (scores -inf) the nodes are arbitrary. grid: candidate_grid(width, k) on log_probs'
    device (made here if None: a host-to-device copy, which a CUDA graph's capture cannot hold)."""
    depth_limit, k = log_probs.shape
    lp = log_probs.float()
    slot_of, rank_of = grid if grid is not None else candidate_grid(width, k, lp.device)
    # every depth keeps `width` entries (-inf: none), so each step has the same shape
    scores = torch.full((depth_limit, width), float("-inf"), dtype=torch.float32, device=lp.device)
    slots = torch.zeros(depth_limit, width, dtype=torch.long, device=lp.device)
    ranks = torch.zeros(depth_limit, width, dtype=torch.long, device=lp.device)
    # (no element set from a Python number: on CUDA that is a host-to-device copy, which a graph cannot capture)
    prev = torch.where(torch.arange(width, device=lp.device) == 0, 0.0, float("-inf")).float()   # the root
    for d in range(depth_limit):
        top, pick = torch.sort(prev[slot_of] + lp[d][rank_of], descending=True, stable=True)
        scores[d], slots[d], ranks[d] = top[:width], slot_of[pick[:width]], rank_of[pick[:width]]
        prev = scores[d]
    tokens = token_ids.gather(1, ranks)
    level = torch.arange(depth_limit, device=lp.device)[:, None]
    parent_flat = torch.where(level == 0, -1, (level - 1) * width + slots)            # the parent's flat index
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[:width]   # [width]
    node_of = torch.zeros(depth_limit * width, dtype=torch.long, device=lp.device)
    node_of[order] = torch.arange(1, width + 1, device=lp.device)
    parent = parent_flat.flatten()[order]
    parents = torch.where(parent < 0, 0, node_of[parent.clamp(min=0)])
    return tokens.flatten()[order], parents, order // width + 1


def verify_rows(root: torch.Tensor, start: torch.Tensor, num_nodes: torch.Tensor, tokens: torch.Tensor,
                parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """A static verify's tree inputs [3, width + 1]: ids (the root's token, then the nodes'), positions (start + depth)
    and parents (-1 for the root) of the tree's num_nodes rows (root included); the rows after them are padding (id 0,
    position start, parent -1: a root of its own). root, start, num_nodes  # [] long; tokens, parents, depths
    # [width] long, nodes 1..width (build_tree_device's)."""
    rows = tokens.shape[0] + 1
    index = torch.arange(rows, device=tokens.device)
    node = (index >= 1) & (index < num_nodes)
    out = torch.zeros(3, rows, dtype=torch.long, device=tokens.device)
    out[0, 1:], out[1, 1:], out[2, 1:] = tokens, depths, parents
    out[0] = torch.where(index == 0, root, torch.where(node, out[0], 0))
    out[1] = start + torch.where(node, out[1], 0)
    out[2] = torch.where(node, out[2], -1)
    return out


def tree_paths_device(parents: torch.Tensor, num_nodes: int | torch.Tensor, max_len: int, num_paths: int) -> torch.Tensor:
    """gdn.tree_paths on the device: (tokens [num_paths * max_len], cu_seqlens [num_paths + 1], node_pos [rows])
    concatenated, for the first num_nodes rows of parents  # [rows] long (the others are padding: they take no
    path, node_pos 0). One path per leaf, root first, in leaf order; paths must be at most max_len long."""
    from ddtree.models.gdn import ancestors_from_parents

    rows = parents.shape[0]
    index = torch.arange(rows, device=parents.device)
    valid = index < num_nodes
    ancestors = ancestors_from_parents(parents)                                 # [rows, rows]: j is i or above it
    depth = ancestors.sum(dim=1) - 1
    has_parent = valid & (parents >= 0)
    children = torch.zeros(rows + 1, dtype=torch.long, device=parents.device)
    children.index_add_(0, torch.where(has_parent, parents, rows), torch.ones_like(parents))
    leaf = valid & (children[:rows] == 0)
    length = torch.where(leaf, depth + 1, 0)
    end = torch.cumsum(length, dim=0)
    begin = end - length
    num_tokens = num_paths * max_len
    # cu_seqlens: 0, then each leaf's end in leaf order, then the total for the padding paths
    bounds = torch.where(torch.arange(num_paths + 2, device=parents.device) == 0, 0, end[-1])
    bounds.scatter_(0, torch.where(leaf, torch.cumsum(leaf.long(), dim=0), num_paths + 1), end)
    # tokens: leaf l's path holds node j (an ancestor-or-self of l) at begin[l] + depth[j]
    on_path = leaf[:, None] & ancestors                                          # [leaf, node]
    where = torch.where(on_path, begin[:, None] + depth[None, :], num_tokens)
    tokens = torch.zeros(num_tokens + 1, dtype=torch.long, device=parents.device)
    tokens.scatter_(0, where.flatten(), index[None, :].expand(rows, rows).flatten())
    # node_pos: the first path through the node (the smallest leaf under it), at the node's depth
    first = torch.where(on_path, begin[:, None], num_tokens).min(dim=0).values + depth
    node_pos = torch.where(valid, first, 0)
    return torch.cat([tokens[:num_tokens], bounds[: num_paths + 1], node_pos])


__all__ = ["build_tree_device", "candidate_grid", "fits_budget", "tree_paths_device", "verify_rows"]
