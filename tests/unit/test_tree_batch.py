"""A forward's trees through our paths kernel in one call per GDN layer (qwen3_5.TreeBatch) against each tree on the
ancestor-masked form: the same logits and, after the requests commit their accepted paths (one replay for all,
gdn.replay_batch, against each request's own commit), the same recurrent state and conv window in every slot.
Random committed states of unit size in each slot make a wrong slot, window or row offset visible (a tiny
model's own states are too small to flip greedy tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.models.dense import Segment
from ddtree.models.gdn import reference_recurrent
from ddtree.models.qwen3_5 import compact_all
from ddtree.tree import build_tree, top_log_probs
from tests.triton_interpreter import AVAILABLE, tree_kernel_module
from tests.unit.test_batching import make_hybrid

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs triton (its interpreter runs our kernel on the CPU)")


def trees(budgets: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for budget in budgets:
        log_probs, token_ids = top_log_probs(torch.randn(7, 64, generator=gen) * 3, budget)
        out.append(build_tree(log_probs, token_ids, budget).parents)
    return out


def forward_and_commit(target, caches, slots, starts, parents, ids, positions):
    segments = []
    for slot, start, tree in zip(slots, starts, parents):
        n = len(tree)
        visibility = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            visibility[i] |= visibility[tree[i]]
        segments.append(Segment.of(caches[slot], start, visibility, parents=list(tree)))
    with torch.no_grad():
        logits, _ = target.forward_packed(ids, positions, segments)
        accepted = []
        for tree in parents:
            path = [len(tree) - 1]                                    # the accepted path: root .. the last node
            while tree[path[-1]] >= 0:
                path.append(tree[path[-1]])
            accepted.append(path[::-1])
        compact_all([caches[slot] for slot in slots], starts, accepted)
    pool = caches[0].gdn_pool
    return logits, pool.state.clone(), pool.conv.clone()


@pytest.mark.parametrize("form", ["paths", "chunks", "chunks+gates", "chunks+replay"])
@pytest.mark.parametrize("slots", [[3, 0, 4], [2, 1, 0]])   # scattered slots (gathered), a run of slots (a view)
def test_a_batch_of_trees_through_the_kernel_equals_each_on_the_masked_form(slots, form, tmp_path, monkeypatch):
    """Trees of different sizes in one TreeBatch through our paths kernel, or through the chunk kernel (whole trees,
    tree_kernel.batched_tree_chunks), against each tree alone on the torch masked form; chunks+gates: the gates by the
    conv's kernel too (DDTREE_TREE_GATES=1, no gates kernel of their own); chunks+replay: the commit's recurrence
    through our replay kernel, in place in the pool (kernels.replay_kernel)."""
    from ddtree.models import fused, qwen3_5

    target_path, _ = make_hybrid(tmp_path)
    target = qwen3_5.HybridTarget.from_pretrained(target_path)
    caches = target.new_caches(5, 64)
    gen = torch.Generator().manual_seed(0)
    pool = caches[0].gdn_pool
    pool.state.copy_(torch.randn(pool.state.shape, generator=gen))
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    committed = pool.state.clone(), pool.conv.clone()
    starts = [5, 9, 2]
    parents = trees([12, 5, 20], seed=1)
    n = sum(len(p) for p in parents)
    ids = torch.randint(0, 90, (n,), generator=gen)
    positions = torch.cat([torch.tensor(np.array([s + depth(p, i) for i in range(len(p))])) for s, p in zip(starts, parents)])

    def run():
        pool.state.copy_(committed[0])
        pool.conv.copy_(committed[1])
        return forward_and_commit(target, caches, slots, starts, parents, ids, positions)

    masked = run()                                   # CPU: no fused kernel, every tree on the ancestor-masked form
    kernel, batches, make = tree_kernel_module().batched_tree_paths, [], qwen3_5.TreeBatch.of
    monkeypatch.setattr(qwen3_5, "step_gdn_kernel", lambda device: reference_recurrent)
    monkeypatch.setattr(qwen3_5, "tree_gdn_kernel", lambda device: kernel)
    chunks, chunk_calls, chunked = tree_kernel_module().batched_tree_chunks, [], form.startswith("chunks")
    monkeypatch.setattr(qwen3_5, "tree_chunk_kernel",
                        lambda device: (lambda *a: chunk_calls.append(1) or chunks(*a)) if chunked else None)
    conv = tree_kernel_module().conv_windows_in_place   # with the chunk form, the conv through our kernel too
    monkeypatch.setattr(qwen3_5, "conv_windows_kernel",
                        lambda device: (lambda *a, **k: chunk_calls.append(1) or conv(*a, **k)) if chunked else None)
    gates_kernels, gates_into = [], fused.gdn_gates_into
    monkeypatch.setattr(fused, "gdn_gates_into", lambda *a: gates_kernels.append(1) or gates_into(*a))
    monkeypatch.setenv("DDTREE_TREE_GATES", "1" if form == "chunks+gates" else "0")
    monkeypatch.setattr(qwen3_5.TreeBatch, "of", lambda *a: batches.append(len(a[1])) or make(*a))
    replays, replay = [], qwen3_5.replay_batch
    monkeypatch.setattr(qwen3_5, "replay_batch", lambda base, paths, *a: replays.append(len(paths)) or replay(base, paths, *a))
    in_place, in_place_calls = tree_kernel_module().replay_in_place, []
    monkeypatch.setattr(qwen3_5, "replay_kernel", lambda device: (lambda *a: in_place_calls.append(1) or in_place(*a))
                        if form == "chunks+replay" else None)
    batched = run()
    assert batches == [3] and replays == [3], (batches, replays)   # one kernel call per layer, one replay
    assert len(in_place_calls) == (form == "chunks+replay")
    gdn_layers = target.config.layer_types.count("linear_attention")
    assert len(chunk_calls) == (2 * gdn_layers if chunked else 0)
    assert len(gates_kernels) == (0 if form == "chunks+gates" else gdn_layers)
    for name, got, want in zip(("logits", "states", "conv windows"), batched, masked):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(masked[1], committed[0]), "the commits moved the states"


def depth(parents: list[int], node: int) -> int:
    d = 0
    while parents[node] >= 0:
        node, d = parents[node], d + 1
    return d


def test_steps_in_place_equal_the_recurrence_and_write_only_their_slots():
    """`ar` steps through our kernel (tree_kernel.steps_in_place): each sequence's one token from its slot's state,
    the gates computed in the kernel from the raw projections, the output equal to the recurrence (fla's interface in
    torch) on fused.gdn_gates' gates and the new state written over that slot's, the other slots untouched. q, k, v
    (and b, a) are column slices of one output, read where they lie (no copies)."""
    from ddtree.models import fused

    kernels = tree_kernel_module()
    gen = torch.Generator().manual_seed(3)
    h, hv, dk, dv, slots = 2, 4, 16, 32, torch.tensor([3, 0, 4])
    r = slots.shape[0]
    conv = torch.randn(r, 2 * h * dk + hv * dv + 2 * hv, generator=gen)
    q, k, v, b, a = conv.split([h * dk, h * dk, hv * dv, hv, hv], dim=1)
    q, k, v = q.reshape(r, h, dk), k.reshape(r, h, dk), v.reshape(r, hv, dv)
    assert not q.is_contiguous() and not v.is_contiguous() and not b.is_contiguous()
    a = a * 12   # softplus far from 0 on both sides (its small-value branch included)
    decay_rate, dt_bias = -torch.rand(hv, generator=gen) * 4, torch.randn(hv, generator=gen)
    beta, g = fused.gdn_gates.eager(b, a, decay_rate, dt_bias)
    pool = torch.randn(6, hv, dk, dv, generator=gen)
    before = pool.clone()
    o = kernels.steps_in_place(q, k, v, b, a, decay_rate, dt_bias, pool, slots)
    want, finals = reference_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                       initial_state=before[slots], output_final_state=True)
    torch.testing.assert_close(o, want[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], finals, rtol=1e-5, atol=1e-5)
    others = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool[others], before[others])


def test_conv_steps_in_place_equal_the_compiled_conv_and_its_copy():
    """An `ar` step's conv through our kernel (tree_kernel.conv_steps_in_place): the output of fused.conv_steps_pooled,
    and each slot's window shifted in place as its index_copy writes it, other slots untouched; x a column slice."""
    from ddtree.models import fused

    kernels = tree_kernel_module()
    gen = torch.Generator().manual_seed(5)
    c, kw, slots = 300, 4, torch.tensor([3, 0, 4])
    x = torch.randn(3, c + 7, generator=gen)[:, 7:]
    layers = torch.randn(6, 2, c, kw, generator=gen)          # a pool's [slots, layers, C, K], layer 1's view
    weight = torch.randn(c, kw, generator=gen)
    want, shifted = fused.conv_steps_pooled.eager(x, layers[:, 1], slots, weight)
    expected = layers.clone()
    expected[:, 1].index_copy_(0, slots, shifted)
    got = kernels.conv_steps_in_place(x, layers[:, 1], slots, weight, block_c=128)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(layers, expected)


def test_conv_windows_in_place_equal_the_compiled_tree_conv():
    """A tree batch's conv through our kernel (tree_kernel.conv_windows_in_place): the output and the input copy that
    fused.conv_windows_pooled_into writes into the commit stash, the windows mixing committed inputs read from
    scattered pool slots with rows of x (a column slice), the pool untouched."""
    from ddtree.models import fused

    kernels = tree_kernel_module()
    gen = torch.Generator().manual_seed(6)
    c, kw, slots, n = 300, 4, torch.tensor([3, 0, 4]), 7
    x = torch.randn(n, c + 5, generator=gen)[:, 5:]
    pool = torch.randn(6, 2, c, kw, generator=gen)          # a pool's [slots, layers, C, K], layer 0's view
    weight = torch.randn(c, kw, generator=gen)
    committed = slots.shape[0] * kw
    window = torch.randint(0, committed + n, (n, kw), generator=gen)
    window[:, -1] = committed + torch.arange(n)                   # each row's own input last
    want, want_x = torch.zeros(n, c), torch.zeros(n, c)
    fused.conv_windows_pooled_into.eager(x, pool[:, 0], slots, weight, window, want, want_x)
    before = pool.clone()
    got, got_x = torch.zeros(n, c + 3)[:, 3:], torch.zeros(n, c)
    kernels.conv_windows_in_place(x, pool[:, 0], slots, weight, window, got, got_x, block_c=128)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_x, want_x) and torch.equal(pool, before)


def test_conv_windows_in_place_writes_the_gates_as_the_gates_chain_does():
    """With gates (kernels.tree_gates) the conv's kernel also writes each row's beta and g from the raw projections b,
    a (column slices of one output, read where they lie) as fused.gdn_gates_into writes them, the conv unchanged."""
    from ddtree.models import fused

    kernels = tree_kernel_module()
    gen = torch.Generator().manual_seed(8)
    c, kw, slots, n, hv = 300, 4, torch.tensor([3, 0, 4]), 7, 6
    x = torch.randn(n, c + 5, generator=gen)[:, 5:]
    pool = torch.randn(6, 2, c, kw, generator=gen)
    weight = torch.randn(c, kw, generator=gen)
    committed = slots.shape[0] * kw
    window = torch.randint(0, committed + n, (n, kw), generator=gen)
    window[:, -1] = committed + torch.arange(n)
    projections = torch.randn(n, 3 + 2 * hv, generator=gen)
    b, a = projections[:, 3:3 + hv], projections[:, 3 + hv:] * 12   # softplus's both branches
    a = projections[:, 3 + hv:].copy_(a)
    decay_rate, dt_bias = -torch.rand(hv, generator=gen) * 4, torch.randn(hv, generator=gen)
    want, want_x, want_beta, want_g = torch.zeros(n, c), torch.zeros(n, c), torch.zeros(n, hv), torch.zeros(n, hv)
    fused.conv_windows_pooled_into.eager(x, pool[:, 0], slots, weight, window, want, want_x)
    fused.gdn_gates_into.eager(b, a, decay_rate, dt_bias, want_beta, want_g)
    got, got_x, beta, g = torch.zeros(n, c), torch.zeros(n, c), torch.zeros(2, n, hv), torch.zeros(2, n, hv)
    kernels.conv_windows_in_place(x, pool[:, 0], slots, weight, window, got, got_x, block_c=128,
                                  gates=(b, a, decay_rate, dt_bias, beta[1], g[1]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_x, want_x)
    torch.testing.assert_close(beta[1], want_beta, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g[1], want_g, rtol=1e-5, atol=1e-6)
    assert not beta[0].any() and not g[0].any()   # each row's gates where its own stash layer says


def test_the_paths_kernel_reads_strided_rows_as_contiguous_ones():
    """The paths kernel reads q, k, v as column slices of the conv's output (row stride conv_dim) and gives what it
    gives for contiguous copies of them."""
    kernels = tree_kernel_module()
    gen = torch.Generator().manual_seed(4)
    h, hv, dk, dv, n = 2, 4, 16, 32, 6
    conv = torch.randn(n, 2 * h * dk + hv * dv, generator=gen)
    q, k, v = conv.split([h * dk, h * dk, hv * dv], dim=1)
    q, k, v = q.reshape(n, h, dk), k.reshape(n, h, dk), v.reshape(n, hv, dv)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    tokens, first, last = torch.tensor([0, 1, 2, 0, 3, 4, 5]), torch.tensor([0, 3]), torch.tensor([3, 7])
    states, path_state = torch.randn(2, hv, dk, dv, generator=gen), torch.tensor([1, 0])
    strided = kernels.batched_tree_paths(q, k, v, g, beta, tokens, first, last, states, path_state)
    dense = kernels.batched_tree_paths(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, tokens, first, last,
                                       states, path_state)
    assert strided.abs().sum() > 0
    torch.testing.assert_close(strided, dense, rtol=0, atol=0)


def test_chunk_shapes_take_an_optional_key_block_from_the_environment(monkeypatch):
    """DDTREE_CHUNK_SHAPES: bn:columns:warps, and a fourth field for the key columns a step of the chunk kernel's passes
    over the key dim (perf/gpu_ratios.py's static-chunkk16 / static-chunkk32); the defaults where it names none."""
    module = tree_kernel_module()
    monkeypatch.setenv("DDTREE_CHUNK_SHAPES", "")
    assert module.chunk_shape(16) == (*module.CHUNK_SHAPES[16], module.CHUNK_BLOCK_K) == (64, 4, 64)
    monkeypatch.setenv("DDTREE_CHUNK_SHAPES", "16:32:2:16,64:128:8")
    assert module.chunk_shape(16) == (32, 2, 16)
    assert module.chunk_shape(64) == (128, 8, 64)
    assert module.chunk_shape(32) == (64, 4, 64)


def test_replay_in_place_equals_the_chain_kernels_replay_and_writes_only_its_slots():
    """A replay commit through our kernel (tree_kernel.replay_in_place: each request's accepted path walked by every
    layer's value heads from its slot's state, written back there) == gdn.replay_apply through the chain kernel's
    interface (fla's, in torch) for requests in scattered slots, with grouped value heads, a padding row (valid 0) and
    a request whose path is empty (its slot untouched, as every slot no request names); the stash read where it lies
    (rows of a batch's stash, any order)."""
    from ddtree.models.gdn import ReplayStash, replay_apply

    kernels = tree_kernel_module()
    gen = torch.Generator().manual_seed(5)
    layers, key_heads, heads, dk, dv, channels = 3, 2, 6, 16, 32, 8
    stash = ReplayStash.empty(layers, 11, heads, dk, dv, channels, torch.float32, "cpu", key_heads=key_heads)
    stash.qkv.copy_(torch.randn(stash.qkv.shape, generator=gen))
    stash.g.copy_(-torch.rand(stash.g.shape, generator=gen))
    stash.beta.copy_(torch.rand(stash.beta.shape, generator=gen))
    pool = torch.randn(6, layers, heads, dk, dv, generator=gen)
    before = pool.clone()
    paths = [[2, 5, 9], [], [0, 1, 4, 7, 10]]        # rows of the stash; the second request's path is empty
    slots = torch.tensor([4, 1, 0])
    rows = torch.tensor([row for p in paths for row in p])
    bounds = torch.tensor(np.cumsum([0] + [len(p) for p in paths]))
    valid = torch.ones(rows.shape[0], dtype=torch.float32)
    valid[4] = 0                                     # the third path's second row: a padding row
    kernels.replay_in_place(stash, rows, bounds, pool, slots, valid)
    columns = torch.zeros(3 * 4, dtype=torch.long)   # unread here: the windows are replay_windows' (not the kernel's)
    want, _ = replay_apply(stash, rows, bounds, columns, before[slots], torch.zeros(3, layers, channels, 4),
                           reference_recurrent, valid)
    torch.testing.assert_close(pool[slots], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[1], before[1]) and torch.equal(pool[[2, 3, 5]], before[[2, 3, 5]])
    assert not torch.allclose(pool[4], before[4]) and not torch.allclose(pool[0], before[0])


def test_the_replay_kernel_runs_by_default_where_our_steps_kernel_runs(monkeypatch):
    """kernels.replay_kernel: our in-place replay wherever our steps kernel runs (CUDA), unless DDTREE_REPLAY_KERNEL
    is 0 or empty; never without the steps kernel (the CPU)."""
    from ddtree.models import kernels

    monkeypatch.delenv("DDTREE_REPLAY_KERNEL", raising=False)
    assert kernels.replay_kernel(torch.device("cpu")) is None
    monkeypatch.setattr(kernels, "steps_gdn_kernel", lambda device: object())
    assert kernels.replay_kernel(torch.device("cpu")) is tree_kernel_module().replay_in_place
    for off in ("0", ""):
        monkeypatch.setenv("DDTREE_REPLAY_KERNEL", off)
        assert kernels.replay_kernel(torch.device("cpu")) is None
