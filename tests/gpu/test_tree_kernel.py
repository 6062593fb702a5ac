"""The tree-paths Triton kernel (ddtree.models.tree_kernel) against the per-node reference recurrence.

On a CUDA machine it runs the compiled kernel; elsewhere Triton's interpreter runs it on CPU tensors
(tests/triton_interpreter.py; triton is a test requirement, fla is not); without triton it is skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.models.gdn import gdn_sequential, tree_paths
from tests.triton_interpreter import AVAILABLE, tree_kernel_module

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs a CUDA GPU, or triton for its interpreter")
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def module():
    return tree_kernel_module()


@pytest.fixture(scope="module")
def kernel(module):
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


def test_batched_tree_paths_start_each_tree_from_its_own_slot(module):
    """Three trees of a batch in one call: each path from its request's state, a slot of a pool whose states lie
    layers apart (the recurrent pool's layer view), rows of each tree at its own offset; == each tree alone."""
    h, hv, dk, dv, rows, slots, layers = 2, 4, 16, 8, 9, 5, 3
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(3)
    trees = [random_tree(n, rng) for n in (9, 4, 6)]
    n = rows * len(trees)
    q, k = (torch.randn(n, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    pool = torch.randn(slots, layers, hv, dk, dv, generator=gen) * 0.1
    layer, request_slots = 1, [4, 0, 2]
    tokens, first, last, path_state = [], [], [], []
    for r, parents in enumerate(trees):
        t, bounds, _ = tree_paths(parents, max_len=16, num_paths=len(parents) + 1)   # one empty padding path each
        first += list(len(tokens) + bounds[:-1])
        last += list(len(tokens) + bounds[1:])
        tokens += list(r * rows + t)
        path_state += [request_slots[r]] * (len(bounds) - 1)
    as_long = (lambda x: torch.tensor(x, dtype=torch.long, device=DEVICE))
    got = module.batched_tree_paths(*(x.to(DEVICE) for x in (q, k, v, g, beta)), as_long(tokens), as_long(first),
                                    as_long(last), pool.to(DEVICE)[:, layer], as_long(path_state)).cpu()
    repeat = hv // h
    for r, parents in enumerate(trees):
        at = slice(r * rows, r * rows + len(parents))
        want, _ = gdn_sequential(q[at].double().repeat_interleave(repeat, 1), k[at].double().repeat_interleave(repeat, 1),
                                 v[at].double(), g[at].double(), beta[at].double(), parents,
                                 pool[request_slots[r], layer].double())
        torch.testing.assert_close(got[at].double(), want, rtol=1e-4, atol=1e-4)
        assert not got[r * rows + len(parents) : (r + 1) * rows].any(), "rows on no path stay 0"


def chain_depth(parents: list[int]) -> int:
    """The most rows on a root-to-leaf path."""
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth)


# the key dim in 2 blocks, in 1; 27B's key dim (128) in 2 at the default step (tree_kernel.CHUNK_BLOCK_K)
@pytest.mark.parametrize("dtype, block_k, dk", [(torch.float32, 16, 32), (torch.bfloat16, 32, 32), (torch.float32, None, 128)])
def test_the_chunk_kernel_equals_the_per_node_recurrence(module, dtype, block_k, dk):
    """Trees of a batch through the ancestor-masked chunk form (batched_tree_chunks), each from its own slot of a
    pool whose states lie layers apart, rows at their tree's offset, q, k, v column slices of one conv output: every
    row of every tree == gdn_sequential on it alone (a chain, a bushy tree, a tree of one row below the root, a tree
    padded as a static forward pads: rows that are roots of their own, whose values are unspecified but finite)."""
    h, hv, dv, rows, slots, layers = 2, 4, 40, 17, 5, 3
    rng, gen = np.random.default_rng(11), torch.Generator().manual_seed(11)
    trees = [list(range(-1, 16)), random_tree(17, rng), [-1, 0], random_tree(12, rng) + [-1] * 3]
    n = rows * len(trees)
    conv = torch.randn(n, 2 * h * dk + hv * dv, generator=gen)
    q, k, v = conv.split([h * dk, h * dk, hv * dv], dim=1)
    q, k, v = q.reshape(n, h, dk), k.reshape(n, h, dk), v.reshape(n, hv, dv)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    pool = torch.randn(slots, layers, hv, dk, dv, generator=gen) * 0.1
    layer, request_slots = 2, [4, 0, 2, 3]
    ancestors = torch.zeros(len(trees), rows, rows, dtype=torch.bool)
    for r, parents in enumerate(trees):
        for i, p in enumerate(parents):
            ancestors[r, i, i] = True
            if p >= 0:
                ancestors[r, i] |= ancestors[r, p]
    as_long = (lambda x: torch.tensor(x, dtype=torch.long, device=DEVICE))
    got = module.batched_tree_chunks(*(x.to(dtype).to(DEVICE) for x in (q, k, v)), g.to(DEVICE),
                                     beta.to(dtype).to(DEVICE), as_long([r * rows for r in range(len(trees))]),
                                     as_long([len(p) for p in trees]), ancestors.to(DEVICE), pool.to(DEVICE)[:, layer],
                                     as_long(request_slots), max_rows=rows, max_depth=max(map(chain_depth, trees)),
                                     block_k=block_k).cpu()
    assert got.dtype == dtype
    repeat = hv // h
    tolerance = 2e-4 if dtype == torch.float32 else 5e-2
    for r, parents in enumerate(trees):
        at = slice(r * rows, r * rows + len(parents))
        real = next((i for i, p in enumerate(parents) if i and p < 0), len(parents))   # rows below the root
        def as_input(x):
            return x[at].to(dtype).double()
        want, _ = gdn_sequential(as_input(q).repeat_interleave(repeat, 1), as_input(k).repeat_interleave(repeat, 1),
                                 as_input(v), g[at].double(), as_input(beta), parents, pool[request_slots[r], layer].double())
        torch.testing.assert_close(got[at][:real].double(), want[:real], rtol=tolerance, atol=tolerance)
        assert torch.isfinite(got[at]).all()


def test_the_chunk_kernel_needs_enough_factors_for_the_depth(module):
    """A chain of 16 rows below the root told its paths are shorter than they are (too few factors of the inverse)
    differs from the recurrence: the factor count does the work (the test above would pass on any count that is
    large enough, this one fails on one too small)."""
    h, hv, dk, dv, rows = 1, 1, 16, 16, 17
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(rows, h, dk, generator=gen) for _ in range(2))
    k[:] = k[:1]                                        # every key the same: L's powers stay large
    v = torch.randn(rows, hv, dv, generator=gen)
    g, beta = torch.zeros(rows, hv), torch.ones(rows, hv)
    chain = list(range(-1, rows - 1))
    ancestors = torch.tril(torch.ones(rows, rows, dtype=torch.bool))[None]
    state = torch.zeros(1, hv, dk, dv)
    args = [x.to(DEVICE) for x in (q, k, v, g, beta)]
    want, _ = gdn_sequential(q.double(), k.double(), v.double(), g.double(), beta.double(), chain, state[0].double())
    run = (lambda depth: module.batched_tree_chunks(*args, torch.zeros(1, dtype=torch.long, device=DEVICE),
                                                    torch.full((1,), rows, dtype=torch.long, device=DEVICE),
                                                    ancestors.to(DEVICE), state.to(DEVICE),
                                                    torch.zeros(1, dtype=torch.long, device=DEVICE), max_rows=rows,
                                                    max_depth=depth, precision="ieee").cpu().double())
    torch.testing.assert_close(run(rows), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(run(9), want, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not CUDA, reason="the engine path needs CUDA (fla for the commit replay)")
def test_engine_with_the_tree_kernel_decodes_what_it_decodes_with_fla(monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards, graphs) on the tiny hybrid with our kernel (DDTREE_TREE_KERNEL=1, the
    default) == with fla's paths form (=0); at budget 64 against the ancestor-masked form (fla's limit is 33 rows)."""
    from ddtree.config import EngineConfig
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens
    from tests.unit.oracle import make_tiny_hybrid

    root, _ = make_tiny_hybrid(tmp_path)
    config = EngineConfig(target_path=str(root / "target"), drafter_path=str(root / "dflash"), max_model_len=300,
                          max_tree_budget=64, device="cuda")
    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_TREE_KERNEL", config,
                                      [("dflash", 1), ("ddtree", 8), ("ddtree", 16), ("ddtree", 32), ("ddtree", 64)], seed=6)


@pytest.mark.skipif(not CUDA, reason="the engine path needs CUDA (fla for the commit replay)")
def test_a_batch_of_trees_through_the_kernel_decodes_what_each_decodes_alone(monkeypatch, tmp_path):
    """Eight concurrent greedy requests (fp32, static batch programs, graphs) with every tree of a round in one
    kernel call per layer == each request alone on fla's paths form."""
    import random

    from ddtree.config import EngineConfig
    from ddtree.engine import Engine
    from ddtree.models import qwen3_5
    from ddtree.request import Request
    from ddtree.sampling_params import SamplingParams
    from tests.unit.oracle import make_tiny_hybrid

    root, _ = make_tiny_hybrid(tmp_path)
    rng = random.Random(7)
    jobs = [([rng.randrange(90) for _ in range(rng.randint(5, 60))],
             SamplingParams(mode="ddtree", tree_budget=(8, 16, 32, 64)[i % 4], max_tokens=40, ignore_eos=True))
            for i in range(8)]
    config = dict(target_path=str(root / "target"), drafter_path=str(root / "dflash"), max_model_len=300,
                  max_tree_budget=64, device="cuda")
    monkeypatch.setenv("DDTREE_TREE_KERNEL", "0")
    alone = Engine(EngineConfig(**config, max_num_seqs=1))
    expected = [alone.generate_ids(prompt, params).output_ids for prompt, params in jobs]
    monkeypatch.setenv("DDTREE_TREE_KERNEL", "1")
    batches, make = [], qwen3_5.TreeBatch.of
    monkeypatch.setattr(qwen3_5.TreeBatch, "of", lambda *a: batches.append(len(a[1])) or make(*a))
    engine = Engine(EngineConfig(**config, max_num_seqs=8))
    requests = [Request(request_id=f"r{i}", prompt_ids=p, params=params) for i, (p, params) in enumerate(jobs)]
    for request in requests:
        engine.add(request)
    while engine.has_work:
        engine.step()
    assert max(batches) >= 4, batches
    for i, request in enumerate(requests):
        assert request.output_ids == expected[i], f"request {i} budget {jobs[i][1].tree_budget}"


def conv_case(seed: int) -> tuple:
    """(x, pool, slots, weight, window, generator) of a 17-row tree batch's conv at Qwen3.6-27B's conv width (bf16) on
    a GPU, 300 channels in float32 elsewhere: two requests' committed windows in a pool of 5, each row's window mixing
    them with rows of x, its own input last."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    gen = torch.Generator().manual_seed(seed)
    c, kw, slots, n = 10240 if CUDA else 300, 4, torch.tensor([3, 0]), 17
    x = torch.randn(n, c, generator=gen).to(DEVICE, dtype)
    pool = torch.randn(5, c, kw, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(c, kw, generator=gen) * 0.5).to(DEVICE, dtype)
    window = torch.randint(0, 2 * kw + n, (n, kw), generator=gen)
    window[:, -1] = 2 * kw + torch.arange(n)
    return x, pool, slots.to(DEVICE), weight, window.to(DEVICE), gen


def test_conv_windows_in_place_equals_the_tree_conv(module):
    """A tree batch's GDN conv through our kernel (conv_windows_in_place, bf16 on a GPU) == fused.conv_windows_pooled_
    into's eager form at Qwen3.6-27B's conv width: the output and the stash copy of the input."""
    from ddtree.models import fused

    x, pool, slots, weight, window, _ = conv_case(seed=9)
    n, c, dtype = *x.shape, x.dtype
    want, want_x = torch.empty(n, c, device=DEVICE, dtype=dtype), torch.empty(n, c, device=DEVICE, dtype=dtype)
    fused.conv_windows_pooled_into.eager(x, pool, slots, weight, window, want, want_x)
    got, got_x = torch.empty_like(want), torch.empty_like(want_x)
    module.conv_windows_in_place(x, pool, slots, weight, window, got, got_x)
    tolerance = 2e-2 if CUDA else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(got_x, want_x)


def test_conv_windows_in_place_writes_the_gates_of_the_gates_chain(module):
    """With gates (DDTREE_TREE_GATES) the conv's kernel writes each row's beta and g from the raw projections b, a
    (bf16 column slices of one output on a GPU, at Qwen3.6-27B's 48 value heads) as fused.gdn_gates_into's eager form:
    beta rounded to bf16 as torch's sigmoid rounds it, g in float32; the conv as without."""
    from ddtree.models import fused

    x, pool, slots, weight, window, gen = conv_case(seed=10)
    (n, c), dtype, hv = x.shape, x.dtype, 48
    projections = (torch.randn(n, 2 * hv + 5, generator=gen) * 6).to(DEVICE, dtype)
    b, a = projections[:, 5:5 + hv], projections[:, 5 + hv:]
    decay_rate = (-torch.rand(hv, generator=gen) * 4).to(DEVICE)
    dt_bias = torch.randn(hv, generator=gen).to(DEVICE, dtype)
    want, want_x = torch.empty(n, c, device=DEVICE, dtype=dtype), torch.empty(n, c, device=DEVICE, dtype=dtype)
    fused.conv_windows_pooled_into.eager(x, pool, slots, weight, window, want, want_x)
    want_beta, want_g = torch.empty(n, hv, device=DEVICE, dtype=dtype), torch.empty(n, hv, device=DEVICE)
    fused.gdn_gates_into.eager(b, a, decay_rate, dt_bias, want_beta, want_g)
    got, got_x = torch.empty_like(want), torch.empty_like(want_x)
    beta, g = torch.empty_like(want_beta), torch.empty_like(want_g)
    module.conv_windows_in_place(x, pool, slots, weight, window, got, got_x, gates=(b, a, decay_rate, dt_bias, beta, g))
    tolerance = 2e-2 if CUDA else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(got_x, want_x)
    torch.testing.assert_close(beta.float(), want_beta.float(), rtol=0, atol=2 ** -8)   # one bf16 ulp below 1 at most
    torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-6)


def test_hybrid_engine_with_the_gates_in_the_conv_kernel_decodes_what_it_decodes_without(tiny_models, monkeypatch,
                                                                                          tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with a tree batch's gates from the conv's kernel
    (DDTREE_TREE_GATES=1, kernels.tree_gates) == from their own compiled kernel."""
    if not CUDA:
        pytest.skip("the engine's tree kernels run on CUDA")
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_TREE_GATES", tiny_config("hybrid", tiny_models, tmp_path),
                                      [("dflash", 1), ("ddtree", 16)], seed=9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_in_place_equals_the_chain_kernels_replay(module, dtype):
    """A replay commit through our kernel (tree_kernel.replay_in_place, the states written where they lie) == through
    the chain kernel (fla's fused recurrent on CUDA, its interface in torch elsewhere; gdn.replay_apply) at Qwen3.6's
    head shapes (16 key heads, 48 value heads, 128 x 128), two requests in scattered slots of a batch's stash, one
    padding row."""
    from ddtree.models import kernels
    from ddtree.models.gdn import ReplayStash, reference_recurrent, replay_apply

    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("Triton's interpreter has no bf16")
    chain = kernels.step_gdn_kernel(torch.device(DEVICE)) if CUDA else reference_recurrent
    gen = torch.Generator().manual_seed(21)
    layers, key_heads, heads, dk, dv, channels = 2, 16, 48, 128, 128, 8
    stash = ReplayStash.empty(layers, 17, heads, dk, dv, channels, dtype, DEVICE, key_heads=key_heads)
    stash.qkv.copy_(torch.randn(stash.qkv.shape, generator=gen))
    stash.g.copy_(-torch.rand(stash.g.shape, generator=gen) * 0.5)
    stash.beta.copy_(torch.rand(stash.beta.shape, generator=gen))
    pool = torch.randn(4, layers, heads, dk, dv, generator=gen).div(8).to(DEVICE)
    before = pool.clone()
    paths = [[0, 3, 8, 12], [1, 2, 16]]
    slots = torch.tensor([3, 1], device=DEVICE)
    rows = torch.tensor([row for p in paths for row in p], device=DEVICE)
    bounds = torch.tensor([0, 4, 7], device=DEVICE)
    valid = torch.ones(7, device=DEVICE)
    valid[6] = 0
    module.replay_in_place(stash, rows, bounds, pool, slots, valid)
    want, _ = replay_apply(stash, rows, bounds, torch.zeros(2 * 4, dtype=torch.long, device=DEVICE), before[slots],
                           torch.zeros(2, layers, channels, 4, dtype=dtype, device=DEVICE), chain, valid.to(dtype))
    torch.testing.assert_close(pool[slots], want, rtol=1e-4, atol=1e-5)
    assert torch.equal(pool[[0, 2]], before[[0, 2]])


def test_hybrid_engine_with_the_replay_kernel_decodes_what_it_decodes_without(tiny_models, monkeypatch, tmp_path):
    """Greedy tokens (fp32, static forwards with graphs) with the commits' recurrence through our replay kernel, in
    place (DDTREE_REPLAY_KERNEL=1, kernels.replay_kernel) == through fla's kernel and a copy."""
    if not CUDA:
        pytest.skip("the engine's tree kernels run on CUDA")
    from tests.gpu.switches import assert_switch_keeps_greedy_tokens, tiny_config

    assert_switch_keeps_greedy_tokens(monkeypatch, "DDTREE_REPLAY_KERNEL", tiny_config("hybrid", tiny_models, tmp_path),
                                      [("dflash", 1), ("ddtree", 16), ("ddtree", 64)], seed=17)
