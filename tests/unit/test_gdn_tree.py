"""Tree Gated DeltaNet: WY tree form == per-node recurrence == transformers on chains; tree conv == brute force; memory at N=1025."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddtree.models.gdn import (
    _root_path,
    conv_state_after,
    conv_tree,
    gdn_sequential,
    gdn_state_at,
    gdn_tree,
    parents_from_visibility,
)
from ddtree.tree import build_tree, top_log_probs

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------------------------
# trees and inputs


def make_tree(kind: str, n: int, seed: int = 0) -> list[int]:
    """Parent list (topological, -1 = continues from the committed state) of a tree of the given kind."""
    rng = random.Random(seed)
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "bush0":            # root + all other nodes children of node 0
        return [-1] + [0] * (n - 1)
    if kind == "forest":           # every node continues straight from the committed state
        return [-1] * n
    if kind == "random":           # uniform random parent, -1 allowed
        return [rng.randint(-1, i - 1) for i in range(n)]
    if kind == "deepish":          # mostly extends the previous node, sometimes branches
        return [-1] + [i - 1 if rng.random() < 0.7 else rng.randint(0, i - 1) for i in range(1, n)]
    if kind == "binary":
        return [(i - 1) // 2 for i in range(n)]
    if kind == "ddtree":           # best-first DDTree over 15 depths, root 0
        return ddtree_parents(n - 1, seed)
    raise ValueError(kind)


def ddtree_parents(budget: int, seed: int, depths: int = 15) -> list[int]:
    """Parents of build_tree(budget) on random peaked draft logits with `depths` depths."""
    gen = torch.Generator().manual_seed(seed)
    log_probs, token_ids = top_log_probs(torch.randn(depths, 1000, generator=gen) * 10, 32)
    parents = list(build_tree(log_probs, token_ids, budget).parents)
    assert parents[0] == -1 and len(parents) == budget + 1
    return parents


def make_inputs(n: int, hv: int, dk: int, dv: int, seed: int, dtype=torch.float64, zero_state: bool = False):
    """Random q, k, v [N, HV, d], g (log decay <= 0), beta in (0, 1) [N, HV], initial state [HV, dk, dv]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hv, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(n, hv, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(n, hv, dv, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(n, hv, generator=gen, dtype=torch.float64) * 1.5)
    beta = torch.sigmoid(torch.randn(n, hv, generator=gen, dtype=torch.float64))
    s0 = torch.randn(hv, dk, dv, generator=gen, dtype=torch.float64) * 0.5
    if zero_state:
        s0.zero_()
    return [x.to(dtype) for x in (q, k, v, g, beta, s0)]


def deepest_leaf(parents: list[int]) -> int:
    """The last node among those of maximal depth."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    best = max(depth)
    return max(i for i, d in enumerate(depth) if d == best)


def visibility_of(parents: list[int]) -> torch.Tensor:
    """Brute-force ancestor-or-self matrix."""
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


TREES = [("chain", 40), ("chain", 1), ("chain", 3), ("bush0", 30), ("forest", 12), ("random", 50), ("deepish", 60),
         ("binary", 31), ("ddtree", 65)]


# ----------------------------------------------------------------------------------------------------------------------
# gated delta rule


@pytest.mark.parametrize("kind,n", TREES)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_matches_sequential_float64(kind, n, seed):
    hv, dk, dv = 4, 8, 6
    parents = make_tree(kind, n, seed)
    q, k, v, g, beta, s0 = make_inputs(n, hv, dk, dv, seed=100 + seed, zero_state=(seed == 1))
    o_ref, states = gdn_sequential(q, k, v, g, beta, parents, s0)
    o, stash = gdn_tree(q, k, v, g, beta, parents, s0, head_chunk=3)
    assert o.dtype == torch.float64
    err = (o - o_ref).abs().max().item()
    assert err < 1e-10, f"kind={kind} N={n} seed={seed}: max |o_tree - o_seq| = {err:.3g}"
    leaf = deepest_leaf(parents)
    for node in sorted({0, n // 2, n - 1, leaf}):
        s = gdn_state_at(stash, node, s0)
        err = (s - states[node]).abs().max().item()
        assert err < 1e-10, f"kind={kind} N={n} seed={seed} node={node} (deepest leaf {leaf}): max |state| err = {err:.3g}"
    assert torch.equal(gdn_state_at(stash, -1, s0), s0), f"kind={kind} N={n}: node -1 must give the committed state"


@pytest.mark.parametrize("head_chunk", [1, 2, 5, None])
def test_head_chunk_does_not_change_results(head_chunk):
    parents = make_tree("random", 33, seed=3)
    q, k, v, g, beta, s0 = make_inputs(33, 5, 8, 6, seed=7)
    o_all, stash_all = gdn_tree(q, k, v, g, beta, parents, s0, head_chunk=5)
    o, stash = gdn_tree(q, k, v, g, beta, parents, s0, head_chunk=head_chunk)
    err = (o - o_all).abs().max().item()
    assert err < 1e-13, f"head_chunk={head_chunk} N=33: outputs differ by {err:.3g}"
    err = (stash.v_new - stash_all.v_new).abs().max().item()
    assert err < 1e-13, f"head_chunk={head_chunk} N=33: v_new differs by {err:.3g}"


@pytest.mark.parametrize("kind,n,hv,dk,dv", [("chain", 40, 4, 8, 6), ("random", 50, 4, 8, 6), ("bush0", 30, 4, 8, 6),
                                             ("ddtree", 257, 2, 128, 128), ("chain", 200, 1, 128, 128)])
def test_tree_float32_close_to_float64_reference(kind, n, hv, dk, dv):
    parents = make_tree(kind, n, seed=5)
    q, k, v, g, beta, s0 = make_inputs(n, hv, dk, dv, seed=11)
    o_ref, states = gdn_sequential(q, k, v, g, beta, parents, s0)
    f32 = [x.float() for x in (q, k, v, g, beta, s0)]
    o, stash = gdn_tree(*f32[:5], parents, f32[5])
    assert o.dtype == torch.float32 and stash.k.dtype == torch.float32
    err = (o.double() - o_ref).abs().max().item()
    assert err < 1e-4, f"kind={kind} N={n} HV={hv} dk={dk} dv={dv}: float32 tree vs float64 reference max err {err:.3g}"
    leaf = deepest_leaf(parents)
    for node in sorted({0, leaf, n - 1}):
        s = gdn_state_at(stash, node, f32[5])
        assert s.dtype == torch.float32
        err = (s.double() - states[node]).abs().max().item()
        assert err < 1e-4, f"kind={kind} N={n} node={node}: float32 state vs float64 reference max err {err:.3g}"


def test_bfloat16_inputs_return_bfloat16():
    parents = make_tree("random", 20, seed=2)
    q, k, v, g, beta, s0 = make_inputs(20, 2, 8, 8, seed=3)
    o_ref, _ = gdn_sequential(q, k, v, g, beta, parents, s0)
    bf = [x.bfloat16() for x in (q, k, v)]
    o, stash = gdn_tree(*bf, g.float(), beta.float(), parents, s0.float())
    assert o.dtype == torch.bfloat16 and stash.v_new.dtype == torch.float32
    err = (o.double() - o_ref).abs().max().item()
    assert err < 0.1 * o_ref.abs().max().item(), f"kind=random N=20 bf16: max err {err:.3g}"


def test_chain_matches_transformers_recurrent_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

    n, hv, dk, dv = 30, 3, 16, 12
    parents = make_tree("chain", n)
    q, k, v, g, beta, s0 = make_inputs(n, hv, dk, dv, seed=21, dtype=torch.float32)
    o_seq, states = gdn_sequential(q, k, v, g, beta, parents, s0)
    o_tree, stash = gdn_tree(q, k, v, g, beta, parents, s0)
    batched = [x.unsqueeze(0) for x in (q, k, v, g, beta)]  # [B=1, T, H, d] / [1, T, H]
    for name, rule in [("recurrent", torch_recurrent_gated_delta_rule), ("chunk", torch_chunk_gated_delta_rule)]:
        o_hf, s_hf = rule(*batched, initial_state=s0.unsqueeze(0), output_final_state=True, use_qk_l2norm_in_kernel=True)
        tol = 1e-6 if name == "recurrent" else 1e-5
        err = (o_seq - o_hf[0]).abs().max().item()
        assert err < tol, f"chain N={n} vs transformers {name}: gdn_sequential outputs differ by {err:.3g}"
        err = (states[-1] - s_hf[0]).abs().max().item()
        assert err < tol, f"chain N={n} vs transformers {name}: final state differs by {err:.3g}"
        err = (o_tree - o_hf[0]).abs().max().item()
        assert err < 1e-5, f"chain N={n} vs transformers {name}: gdn_tree outputs differ by {err:.3g}"
        err = (gdn_state_at(stash, n - 1, s0) - s_hf[0]).abs().max().item()
        assert err < 1e-5, f"chain N={n} vs transformers {name}: gdn_state_at(last) differs by {err:.3g}"


def test_bad_parents_rejected():
    q, k, v, g, beta, s0 = make_inputs(3, 1, 4, 4, seed=0)
    for parents in ([-1, 1, 0], [-1, 0], [-2, 0, 1]):
        with pytest.raises(ValueError):
            gdn_tree(q, k, v, g, beta, parents, s0)


@pytest.mark.parametrize("kind,n", TREES)
def test_parents_from_visibility_roundtrip(kind, n):
    parents = make_tree(kind, n, seed=4)
    assert parents_from_visibility(visibility_of(parents)) == parents, f"kind={kind} N={n}"


# ----------------------------------------------------------------------------------------------------------------------
# conv along ancestors


def conv_brute(x: torch.Tensor, parents: list[int], conv_state: torch.Tensor, weight: torch.Tensor, node: int) -> torch.Tensor:
    """conv1d over [conv_state columns ++ x(root path of node)], causal depthwise + SiLU, last position."""
    path = []
    j = node
    while j >= 0:
        path.append(j)
        j = parents[j]
    seq = torch.cat([conv_state, x[path[::-1]].T], dim=1)                      # [C, K + len]
    kernel = weight.shape[1]
    out = F.conv1d(seq[None], weight[:, None, :], padding=kernel - 1, groups=seq.shape[0])[0, :, : seq.shape[1]]
    return F.silu(out[:, -1])


CONV_TREES = [("chain", 1), ("chain", 2), ("chain", 3), ("chain", 9), ("bush0", 7), ("forest", 5), ("random", 40),
              ("deepish", 40), ("binary", 15), ("ddtree", 33)]


@pytest.mark.parametrize("kind,n", CONV_TREES)
@pytest.mark.parametrize("kernel", [4, 2])
def test_conv_tree_matches_brute_force(kind, n, kernel):
    channels = 5
    parents = make_tree(kind, n, seed=6)
    gen = torch.Generator().manual_seed(n + kernel)
    x = torch.randn(n, channels, generator=gen, dtype=torch.float64)
    conv_state = torch.randn(channels, kernel, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64)
    out = conv_tree(x, parents, conv_state, weight)
    assert out.shape == (n, channels) and out.dtype == torch.float64
    for node in range(n):
        ref = conv_brute(x, parents, conv_state, weight, node)
        err = (out[node] - ref).abs().max().item()
        assert err < 1e-12, f"kind={kind} N={n} K={kernel} node={node}: conv err {err:.3g}"
        path = []
        j = node
        while j >= 0:
            path.append(j)
            j = parents[j]
        expect = torch.cat([conv_state, x[path[::-1]].T], dim=1)[:, -kernel:]
        got = conv_state_after(x, parents, node, conv_state)
        assert torch.equal(got, expect), f"kind={kind} N={n} K={kernel} node={node}: conv_state_after differs"
    assert torch.equal(conv_state_after(x, parents, -1, conv_state), conv_state), f"kind={kind} N={n}: node -1"


def test_conv_tree_float32_and_bf16():
    parents = make_tree("random", 30, seed=8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 6, generator=gen)
    conv_state, weight = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    ref = conv_tree(x.double(), parents, conv_state.double(), weight.double())
    out32 = conv_tree(x, parents, conv_state, weight)
    assert out32.dtype == torch.float32 and (out32.double() - ref).abs().max().item() < 1e-5, "kind=random N=30 float32 conv"
    out16 = conv_tree(x.bfloat16(), parents, conv_state.bfloat16(), weight.bfloat16())
    assert out16.dtype == torch.bfloat16 and (out16.double() - ref).abs().max().item() < 0.1, "kind=random N=30 bf16 conv"


# ----------------------------------------------------------------------------------------------------------------------
# memory at budget 1024 with Qwen3.6-27B GDN dims


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    sys.path.insert(0, sys.argv[1])
    from ddtree.models.gdn import gdn_sequential, gdn_state_at, gdn_tree
    from tests.unit.test_gdn_tree import ddtree_parents, deepest_leaf, make_inputs

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    parents = ddtree_parents(1024, seed=0)
    n, hv, dk, dv, head_chunk = len(parents), 48, 128, 128, 8
    q, k, v, g, beta, s0 = make_inputs(n, hv, dk, dv, seed=1, dtype=torch.float32)
    gdn_tree(q[:16], k[:16], v[:16], g[:16], beta[:16], parents[:16], s0, head_chunk=head_chunk)  # warm up BLAS/LAPACK
    try:  # reset the peak-RSS mark (Linux >= 4.0); otherwise the pre-call peak makes the number conservative
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method = "VmHWM after clear_refs=5 minus VmRSS before"
    except OSError:
        method = "VmHWM (not reset) minus VmRSS before (upper bound)"
    rss_before = status_kib("VmRSS")
    t0 = time.perf_counter()
    o, stash = gdn_tree(q, k, v, g, beta, parents, s0, head_chunk=head_chunk)
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM") - rss_before
    # spot check against the per-node recurrence (float64) along the deepest root path, 4 heads
    leaf = deepest_leaf(parents)
    path = []
    j = leaf
    while j >= 0:
        path.append(j)
        j = parents[j]
    path = path[::-1]
    heads = slice(0, 4)
    sub = [x[path][:, heads].double() for x in (q, k, v, g, beta)]
    o_ref, states = gdn_sequential(*sub, list(range(-1, len(path) - 1)), s0[heads].double())
    o_err = (o[path][:, heads].double() - o_ref).abs().max().item()
    s_err = (gdn_state_at(stash, leaf, s0)[heads].double() - states[-1]).abs().max().item()
    print(json.dumps(dict(n=n, hv=hv, dk=dk, dv=dv, head_chunk=head_chunk, depth=len(path) - 1, peak_bytes=peak * 1024,
                          method=method, seconds=seconds, stash_bytes=stash.nbytes(), o_err=o_err, s_err=s_err,
                          finite=bool(torch.isfinite(o).all()))))
""")


def test_memory_at_budget_1024_qwen36_27b_dims():
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    n, hv, dk, dv = r["n"], r["hv"], r["dk"], r["dv"]
    per_node_states = n * hv * dk * dv * 4  # 3.2 GB: the per-node-snapshot approach
    print(f"\ngdn_tree N={n} HV={hv} dk={dk} dv={dv} head_chunk={r['head_chunk']} depth={r['depth']}: "
          f"peak +{r['peak_bytes'] / 2**20:.0f} MiB ({r['method']}), {r['seconds']:.2f} s, stash {r['stash_bytes'] / 2**20:.1f} MiB "
          f"(per-node states would be {per_node_states / 2**30:.2f} GiB); path o err {r['o_err']:.2g}, state err {r['s_err']:.2g}")
    assert r["finite"], f"N={n}: non-finite outputs"
    assert r["peak_bytes"] < 2**30, f"N={n} HV={hv}: peak {r['peak_bytes'] / 2**20:.0f} MiB >= 1 GiB (per-node states: 3.2 GB)"
    assert r["stash_bytes"] <= n * hv * (dk + dv + 2) * 4, f"N={n} HV={hv}: stash {r['stash_bytes']} B is not O(N*HV*(dk+dv))"
    assert r["o_err"] < 1e-4 and r["s_err"] < 1e-4, f"N={n} deepest path node: o err {r['o_err']:.3g}, state err {r['s_err']:.3g}"


# ----------------------------------------------------------------------------------------------------------------------
# the paths form (a fused chain kernel over root-to-leaf paths) and its replay commit, with the torch reference kernel


@pytest.mark.parametrize("kind,n", [("chain", 9), ("bush0", 12), ("forest", 5), ("random", 30), ("ddtree", 65),
                                    ("binary", 31)])
def test_paths_form_equals_tree_form(kind, n):
    """Every node's output through its root-to-leaf paths == gdn_tree's; padding (empty paths, spare tokens) is inert."""
    from ddtree.models.gdn import TreePaths, gdn_paths, reference_recurrent, tree_paths

    parents = make_tree(kind, n, seed=n)
    q, k, v, g, beta, s0 = make_inputs(n, 4, 8, 6, seed=n)
    expected, _ = gdn_tree(q, k, v, g, beta, parents, s0)
    assert tree_paths(parents, max_len=2) is None or max(len(_root_path(parents, i)) for i in range(n)) <= 2
    tokens, bounds, node_pos = tree_paths(parents, max_len=n, num_paths=n + 3, num_tokens=n * n + 5)
    paths = TreePaths(*(torch.from_numpy(a) for a in (tokens, bounds, node_pos)))
    assert paths.num_paths == n + 3 and (node_pos >= 0).all()
    for node in range(n):   # a node's path token holds that node, and its path runs from a root down to it
        assert tokens[node_pos[node]] == node
    got = gdn_paths(reference_recurrent, q, k, v, g, beta, paths, s0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)   # the kernel interface: float32 state and g


@pytest.mark.parametrize("kind,n", [("ddtree", 33), ("random", 20)])
def test_replay_commit_equals_stash_commit(kind, n):
    """Committing an accepted path of 3 layers by one replay (layers as heads) == commit_path from the WY stash."""
    from ddtree.models.gdn import ReplayStash, TreeStash, commit_path, reference_recurrent, replay_path

    parents = make_tree(kind, n, seed=3)
    layers, hv, dk, dv, channels, kernel = 3, 4, 8, 6, 5, 4
    tree_stash = TreeStash.empty(layers, n, hv, dk, dv, channels, torch.float64, torch.float64, "cpu")
    replay = ReplayStash.empty(layers, n, hv, dk, dv, channels, torch.float64, "cpu")
    states = torch.randn(layers, hv, dk, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer in range(layers):
        q, k, v, g, beta, _ = make_inputs(n, hv, dk, dv, seed=10 + layer)
        gdn_tree(q, k, v, g, beta, parents, states[layer], out=tree_stash.layer(layer))
        replay.k[layer], replay.v[layer], replay.g[layer], replay.beta[layer] = k, v, g.float(), beta
    x = torch.randn(layers, n, channels, dtype=torch.float64)
    tree_stash.x.copy_(x)
    replay.x.copy_(x)
    path = _root_path(parents, deepest_leaf(parents))
    conv = torch.randn(layers, channels, kernel, dtype=torch.float64)
    state_a, conv_a = states.clone(), conv.clone()
    state_b, conv_b = states.clone(), conv.clone()
    commit_path(tree_stash, path, state_a, conv_a)
    replay_path(replay, path, state_b, conv_b, reference_recurrent)
    torch.testing.assert_close(state_b, state_a, rtol=1e-6, atol=1e-6)   # the replay kernel runs in float32 state
    assert torch.equal(conv_a, conv_b)


def test_paths_form_and_replay_with_grouped_value_heads():
    """Key heads shared by groups of value heads (Qwen3.6: 16 key, 48 value heads) go to the kernel unrepeated:
    == the tree form on repeated keys; the replay of a stash holding key heads == commit_path."""
    from ddtree.models.gdn import ReplayStash, TreePaths, TreeStash, commit_path, gdn_paths, reference_recurrent, replay_path, tree_paths

    parents = make_tree("ddtree", 33, seed=5)
    n, key_heads, heads, dk, dv = 33, 2, 6, 8, 5
    q, k, v, g, beta, s0 = make_inputs(n, heads, dk, dv, seed=9)
    qh, kh = q[:, ::3].contiguous(), k[:, ::3].contiguous()            # 2 key heads, each for 3 value heads
    q_rep, k_rep = qh.repeat_interleave(3, dim=1), kh.repeat_interleave(3, dim=1)
    expected, _ = gdn_tree(q_rep, k_rep, v, g, beta, parents, s0)
    paths = TreePaths(*(torch.from_numpy(a) for a in tree_paths(parents, 16)))
    torch.testing.assert_close(gdn_paths(reference_recurrent, qh, kh, v, g, beta, paths, s0), expected, rtol=1e-5, atol=1e-7)
    tree_stash = TreeStash.empty(2, n, heads, dk, dv, 3, torch.float64, torch.float64, "cpu")
    replay = ReplayStash.empty(2, n, heads, dk, dv, 3, torch.float64, "cpu", key_heads=key_heads)
    states = torch.randn(2, heads, dk, dv, dtype=torch.float64)
    for layer in range(2):
        gdn_tree(q_rep, k_rep * (layer + 1), v, g, beta, parents, states[layer], out=tree_stash.layer(layer))
        replay.k[layer], replay.v[layer], replay.g[layer], replay.beta[layer] = kh * (layer + 1), v, g.float(), beta
    tree_stash.x.zero_()
    replay.x.zero_()
    path = _root_path(parents, deepest_leaf(parents))
    conv = torch.zeros(2, 3, 4, dtype=torch.float64)
    state_a, state_b = states.clone(), states.clone()
    commit_path(tree_stash, path, state_a, conv.clone())
    replay_path(replay, path, state_b, conv.clone(), reference_recurrent)
    torch.testing.assert_close(state_b, state_a, rtol=1e-6, atol=1e-6)
