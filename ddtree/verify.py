"""accept(tree, target logits, params) -> Acceptance: walk the tree with the target's own choices."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.sampling import probabilities, sample
from ddtree.sampling_params import SamplingParams
from ddtree.tree.build import DraftTree


@dataclass(slots=True)
class Acceptance:
    accepted: list[int]   # node indices on the accepted path, root first
    bonus_token: int      # target's own token after the last accepted node

    @property
    def acceptance_length(self) -> int:
        return len(self.accepted)


def accept_greedy(tree: DraftTree, logits: torch.Tensor | None, choice: list[int] | None = None) -> Acceptance:
    """Follow the target's argmax from the root; one device-to-host read for all nodes.

    logits  # [num_nodes + 1, vocab], or choice = its argmax per row, already on the host
    """
    if choice is None:
        choice = logits.argmax(dim=-1).tolist()
    node, accepted = 0, [0]
    while choice[node] in tree.children[node]:
        node = tree.children[node][choice[node]]
        accepted.append(node)
    return Acceptance(accepted=accepted, bonus_token=int(choice[node]))


def accept_sampled(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator) -> Acceptance:
    """Sample the target at each node on the walk and follow the sampled token.

    Every node's logits are conditioned on exactly its ancestors, so each emitted token is a
    draw from the target's own distribution given the committed prefix (target-only
    verification); draft probabilities play no part, so the output distribution is the
    target's whatever the tree is.
    """
    node, accepted = 0, [0]
    while True:
        token = sample(probabilities(logits[node : node + 1], params)[0], generator)
        child = tree.children[node].get(token)
        if child is None:
            return Acceptance(accepted=accepted, bonus_token=token)
        node = child
        accepted.append(node)


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None, greedy_choice: list[int] | None = None) -> Acceptance:
    """greedy_choice: the argmax of every row of logits, when the caller read it for a whole batch at once."""
    if params.is_greedy:
        return accept_greedy(tree, logits, greedy_choice)
    assert generator is not None, "sampling needs a generator"
    return accept_sampled(tree, logits, params, generator)
