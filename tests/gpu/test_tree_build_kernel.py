"""The device tree build in one Triton program (ddtree.models.tree_build_kernel) compiled on the GPU against
build_tree_device (and its verify inputs and paths against verify_rows and tree_paths_device), alone and replayed
from a CUDA graph on new inputs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def case(gen: torch.Generator, depth: int, k: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(3 * torch.randn(depth, max(k, 2), generator=gen), dim=-1)[:, :k]
    log_probs = log_probs.sort(dim=-1, descending=True).values
    if ties:
        log_probs = (log_probs * 2).round() / 2
    return log_probs.cuda(), torch.randint(0, 248320, (depth, k), generator=gen).cuda()


@pytest.mark.parametrize("depth, width, k", [(15, 16, 16), (15, 64, 64), (15, 128, 128), (15, 64, 1), (3, 40, 7)])
def test_kernel_equals_the_tensor_build_and_replays(depth, width, k):
    from ddtree.models.qwen3_5 import PATHS_MAX_LEN
    from ddtree.models.tree_build_kernel import TreeBuildScratch, build_tree_kernel, tree_inputs_kernel
    from ddtree.tree.device import build_tree_device, candidate_grid, tree_paths_device, verify_rows

    gen = torch.Generator().manual_seed(depth * width + k)
    grid = candidate_grid(width, k, "cuda")
    scratch = TreeBuildScratch(depth, width, grid[0].shape[0], torch.device("cuda"))
    for ties in (False, True):
        log_probs, token_ids = case(gen, depth, k, ties)
        want = build_tree_device(log_probs, token_ids, width, grid)
        got = build_tree_kernel(log_probs, token_ids, width, grid, scratch)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), ties
        for n in (1, width // 2 + 1, width):   # the verify's inputs and paths of a tree of n nodes
            inputs = torch.tensor([7, 30, n + 1], device="cuda")
            head = verify_rows(inputs[0], inputs[1], inputs[2], *want)
            got_head, got_paths = tree_inputs_kernel(inputs, scratch, width + 1, PATHS_MAX_LEN)
            assert torch.equal(got_head, head)
            assert torch.equal(got_paths, tree_paths_device(head[2], n + 1, PATHS_MAX_LEN, width + 1))
    static_lp, static_ids = case(gen, depth, k, False)
    build_tree_kernel(static_lp, static_ids, width, grid, scratch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_tree_kernel(static_lp, static_ids, width, grid, scratch)
    for ties in (False, True, False):
        log_probs, token_ids = case(gen, depth, k, ties)
        static_lp.copy_(log_probs)
        static_ids.copy_(token_ids)
        graph.replay()
        want = build_tree_device(log_probs, token_ids, width, grid)
        assert all(torch.equal(w, g) for w, g in zip(want, out)), ties


@pytest.mark.parametrize("top", [16, 64])
def test_draft_top_k_equals_log_softmax_then_topk_at_qwen36s_vocabulary_in_bf16(top):
    """draft_top_k over 15 levels of 248,320 bf16 logits (many ties) and replayed from a CUDA graph on new ones: the
    log-probabilities of log_softmax then torch.topk to float32 rounding, each at a position holding its logit, ties
    in ascending positions."""
    from ddtree.models.tree_build_kernel import draft_top_k
    from tests.unit.test_device_tree import assert_draft_top_k

    gen = torch.Generator().manual_seed(top)
    logits = (3 * torch.randn(15, 248320, generator=gen)).to("cuda", torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    draft_top_k(logits, top)   # compiled before the capture
    with torch.cuda.graph(graph):
        log_probs, positions = draft_top_k(logits, top)
    for _ in range(2):
        logits.copy_((3 * torch.randn(15, 248320, generator=gen)).to(torch.bfloat16))
        graph.replay()
        assert_draft_top_k(logits, log_probs, positions, atol=1e-5)
