"""The tree-paths Triton kernel (ddtree.models.tree_kernel) against the per-node reference recurrence.

On a CUDA machine it runs the compiled kernel; elsewhere, where triton is installed, Triton's interpreter runs it
on CPU tensors (TRITON_INTERPRET=1, set before the kernel is defined); without triton it is skipped (CI's CPU
image has none: fla's trap applies to it too).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import numpy as np
import pytest
import torch

from ddtree.models.gdn import gdn_sequential, tree_paths

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and importlib.util.find_spec("triton") is None,
                                reason="needs a CUDA GPU, or triton for its interpreter")
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def kernel():
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"   # before the module defines its kernel
    module = importlib.import_module("ddtree.models.tree_kernel")
    return module.tree_paths_recurrence


def random_tree(n: int, rng: np.random.Generator) -> list[int]:
    """parents of an n-node tree, node 0 the root, parents[i] < i."""
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


@pytest.mark.parametrize("n, dtype", [(1, torch.float32), (7, torch.float32), (17, torch.float32), (33, torch.bfloat16)])
def test_tree_kernel_equals_per_node_recurrence(kernel, n, dtype):
    rng = np.random.default_rng(n)
    parents = random_tree(n, rng)
    h, hv, dk, dv = 2, 4, 16, 24
    gen = torch.Generator().manual_seed(n)
    q, k = (torch.randn(n, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen)                 # log decay <= 0
    beta = torch.rand(n, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    repeat = hv // h
    want, _ = gdn_sequential(q.double().repeat_interleave(repeat, 1), k.double().repeat_interleave(repeat, 1),
                             v.double(), g.double(), beta.double(), parents, s0.double())
    # padded as a static forward pads: more paths (empty) and tokens than the tree has, and 3 rows past the tree
    tokens, bounds, _ = tree_paths(parents, max_len=16, num_paths=n + 2, num_tokens=n * n + 5)   # the kernel's max_len
    pad = 3
    extend = (lambda x: torch.cat([x, torch.randn(pad, *x.shape[1:], generator=gen)]))
    args = [extend(x).to(dtype).to(DEVICE) for x in (q, k, v)] + [extend(g).to(DEVICE), extend(beta).to(dtype).to(DEVICE)]
    got = kernel(*args, torch.from_numpy(tokens).to(DEVICE), torch.from_numpy(bounds).to(DEVICE), s0.to(DEVICE))
    assert got.dtype == dtype and got.shape == (n + pad, hv, dv)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got[:n].double().cpu(), want, rtol=tolerance, atol=tolerance)
    assert not got[n:].any(), "rows on no path stay 0"


@pytest.mark.skipif(not CUDA, reason="the engine path needs CUDA (fla for the commit replay)")
def test_engine_with_the_tree_kernel_decodes_what_it_decodes_with_fla(monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards, graphs) on the tiny hybrid with DDTREE_TREE_KERNEL=1 == without."""
    from ddtree.config import EngineConfig
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens
    from tests.unit.oracle import make_tiny_hybrid

    root, _ = make_tiny_hybrid(tmp_path)
    config = EngineConfig(target_path=str(root / "target"), drafter_path=str(root / "dflash"), max_model_len=300,
                          max_tree_budget=32, device="cuda")
    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_TREE_KERNEL", config,
                                      [("dflash", 1), ("ddtree", 8), ("ddtree", 16), ("ddtree", 32)], seed=6)
