"""Gated DeltaNet over a tree of query tokens: per-node reference, ancestor-masked WY form, state rebuild, tree conv.

Plain torch (no fla / triton imports). Node order is topological: parents[i] < i, parents[i] == -1 means the node
continues directly from the committed state. Per value head the recurrence is (transformers' torch_recurrent_gated_delta_rule,
use_qk_l2norm_in_kernel=True):

    q <- l2norm(q) / sqrt(dk);  k <- l2norm(k);  S <- e^g S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q

The tree form is exact: S(node) = step(S(parent), node). `gdn_tree` evaluates it with the chunked UT/WY form in which the
causal mask is replaced by the ancestor-or-self mask A and the cumulative decay by the decay summed along the root path
(hybrid_gdn.md §2.2):

    c_i = sum_{j in anc-or-self(i)} g_j;   Gamma[i, j] = e^{c_i - c_j} A[i, j]
    T = I + strictly-lower(diag(beta) K K^T * Gamma);  U = T^-1 diag(beta) V;  W = T^-1 diag(beta e^c) K;  V_new = U - W S0
    O = diag(e^c) Q S0 + (Q K^T * Gamma) V_new;       S(n) = e^{c_n} S0 + sum_{j in anc-or-self(n)} e^{c_n - c_j} k_j v_new_j^T

so no per-node [HV, dk, dv] state is ever materialised; the state of the accepted node is rebuilt from a small stash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ddtree.models import fused
from ddtree.models.base import to_device

L2_EPS = 1e-6                    # l2norm eps of use_qk_l2norm_in_kernel (fla / transformers)
AUTO_HEAD_ELEMENTS = 1 << 24     # head_chunk=None: heads per group so that one [heads, N, N] buffer has <= this many elements


# ----------------------------------------------------------------------------------------------------------------------
# tree structure


def _check_parents(parents: Sequence[int], n: int) -> None:
    """Raise ValueError unless parents has n entries with -1 <= parents[i] < i."""
    if len(parents) != n:
        raise ValueError(f"parents has {len(parents)} entries for {n} nodes")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: need -1 <= parent < node (topological order)")


def _depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (0 for nodes whose parent is -1)."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def _root_path(parents: Sequence[int], node: int) -> list[int]:
    """Ancestors-or-self of `node`, oldest first (empty for node == -1)."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _path_reduce(x: Tensor, parents: Sequence[int], combine, fill) -> Tensor:
    """Reduce x [N, ...] over each node's root path (anc-or-self) by pointer doubling: log2(depth) vectorised steps."""
    n = len(parents)
    steps = max(_depths(parents), default=0).bit_length()      # 2**steps >= max path length
    ptr = torch.tensor([p if p >= 0 else n for p in parents], dtype=torch.long, device=x.device)  # [N]; n = none
    sentinel = torch.full((1,), n, dtype=torch.long, device=x.device)
    pad = torch.full_like(x[:1], fill)
    for _ in range(steps):
        # invariant: x[i] covers the nodes at distance [0, 2**s) above i, ptr[i] is the ancestor at distance 2**s (or n)
        x = combine(x, torch.cat([x, pad])[ptr])
        ptr = torch.cat([ptr, sentinel])[ptr]
    return x


def _ancestor_mask(parents: Sequence[int], device: torch.device) -> Tensor:
    """[N, N] bool, mask[i, j] = j is i or an ancestor of i."""
    steps = max(_depths(parents), default=0).bit_length()
    return ancestors_from_parents(torch.tensor(list(parents), dtype=torch.long, device=device), steps)


def _path_sum(x: Tensor, parents: Sequence[int]) -> Tensor:
    """x [N, ...] summed over each node's root path (anc-or-self)."""
    return _path_reduce(x, parents, torch.add, 0.0)


def ancestors_from_parents(parents: Tensor, steps: int | None = None) -> Tensor:
    """[N, N] bool anc-or-self matrix from a parents tensor [N] long (-1: a root) on any device, by pointer doubling;
    [R, N, N] from parents [R, N] (R trees at once).

    `steps` doublings cover paths up to 2**steps nodes (default: enough for any tree of N nodes). No host reads,
    so it runs inside a CUDA graph with parents in a static buffer.
    """
    if parents.dim() == 1:
        return ancestors_from_parents(parents[None], steps)[0]
    r, n = parents.shape
    steps = max(n - 1, 0).bit_length() if steps is None else steps
    reach = torch.eye(n, dtype=torch.bool, device=parents.device).expand(r, n, n)
    ptr = torch.where(parents < 0, n, parents)                                # [R, N]; n = past the root
    sentinel = torch.full((r, 1), n, dtype=parents.dtype, device=parents.device)
    pad = torch.zeros(r, 1, n, dtype=torch.bool, device=parents.device)
    for _ in range(steps):
        # reach[i] covers the nodes at distance [0, 2**s) above i, ptr[i] is the ancestor at distance 2**s (or n)
        reach = reach | torch.cat([reach, pad], dim=1).gather(1, ptr[:, :, None].expand(r, n, n))
        ptr = torch.cat([ptr, sentinel], dim=1).gather(1, ptr)
    return reach


def conv_window_index(parents: Tensor, kernel: int) -> Tensor:
    """[N, K] long indices into cat(conv_state.T [K, C], x [N, C]): node n's window, oldest first.

    parents  # [N] long on any device; no host reads (runs inside a CUDA graph).
    """
    n = parents.shape[0]
    cur = torch.arange(n, device=parents.device)                              # walking node (or -1 once past the root)
    used = torch.zeros(n, dtype=torch.long, device=parents.device)            # committed inputs consumed so far
    columns = []
    for _ in range(kernel):
        inside = cur >= 0
        columns.append(torch.where(inside, kernel + cur, kernel - 1 - used))
        used = used + (~inside).long()
        cur = torch.where(inside, parents[cur.clamp(min=0)], -1)
    return torch.stack(columns[::-1], dim=1)


@dataclass(slots=True)
class TreePaths:
    """A tree as its root-to-leaf paths, for a fused chain kernel over variable-length sequences (the paths form):
    every node's output is that of any path through it, since a path is exactly the node's recurrence."""
    tokens: Tensor       # [T] long: the node of every path token (paths concatenated, padded with node 0)
    cu_seqlens: Tensor   # [S + 1] long: path boundaries (padding paths are empty)
    node_pos: Tensor     # [N] long: a path token of every node

    @property
    def num_paths(self) -> int:
        return self.cu_seqlens.shape[0] - 1


def leaves(parents: Sequence[int]) -> np.ndarray:
    """Indices of the nodes without children, increasing."""
    par = np.asarray(parents, dtype=np.int64)
    has_child = np.zeros(len(par), dtype=bool)
    has_child[par[par >= 0]] = True
    return np.flatnonzero(~has_child)


def tree_paths(parents: Sequence[int], max_len: int, num_paths: int | None = None, num_tokens: int | None = None,
               num_nodes: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(tokens, cu_seqlens, node_pos) of TreePaths on the host: one path per leaf, root first, in leaf order,
    padded to num_paths paths and num_tokens tokens (and node_pos to num_nodes nodes: rows past the tree, whose
    outputs nobody reads, point at token 0); None if a path is longer than max_len or they do not fit."""
    n = len(parents)
    tokens, bounds, node_pos = [], [0], np.full(n, -1, dtype=np.int64)
    for leaf in leaves(parents):
        path = _root_path(parents, int(leaf))
        if len(path) > max_len:
            return None
        for node in path:
            if node_pos[node] < 0:
                node_pos[node] = len(tokens)
            tokens.append(node)
        bounds.append(len(tokens))
    num_paths = len(bounds) - 1 if num_paths is None else num_paths
    num_tokens = len(tokens) if num_tokens is None else num_tokens
    if len(bounds) - 1 > num_paths or len(tokens) > num_tokens:
        return None
    bounds += [len(tokens)] * (num_paths + 1 - len(bounds))
    node_pos = np.concatenate([node_pos, np.zeros(max(0, (num_nodes or n) - n), dtype=np.int64)])
    return (np.asarray(tokens + [0] * (num_tokens - len(tokens)), dtype=np.int64), np.asarray(bounds, dtype=np.int64),
            node_pos)


@dataclass(slots=True)
class TreeLayout:
    """One forward's tree structure on the device, built once and shared by every GDN layer of it."""
    ancestors: Tensor   # [N, N] bool anc-or-self
    window: Tensor      # [N, K] long conv window index (conv_window_index)
    paths: TreePaths | None = None   # set when the paths form runs (a fused chain kernel on CUDA)

    @classmethod
    def of(cls, parents: Tensor, kernel: int, ancestors: Tensor | None = None,
           paths: TreePaths | None = None) -> "TreeLayout":
        """parents  # [N] long on the forward's device; ancestors where the caller has them already."""
        return cls(ancestors=ancestors_from_parents(parents) if ancestors is None else ancestors.bool(),
                   window=conv_window_index(parents, kernel), paths=paths)


def parents_from_visibility(visibility: Tensor) -> list[int]:
    """Parent list from an [N, N] bool ancestor-or-self matrix: the largest ancestor index < i, or -1."""
    n = visibility.shape[0]
    if n == 0:
        return []
    idx = torch.arange(n, device=visibility.device)
    strict = visibility.bool() & (idx[None, :] < idx[:, None])               # [N, N] strict ancestors
    cand = torch.where(strict, idx[None, :].expand(n, n), torch.full_like(idx, -1)[None, :].expand(n, n))
    return cand.max(dim=1).values.tolist()


# ----------------------------------------------------------------------------------------------------------------------
# gated delta rule


def _l2norm(x: Tensor) -> Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim (fla / transformers l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _normalize_qk(q: Tensor, k: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """l2-normalised q / sqrt(dk) and l2-normalised k, in `dtype`."""
    q = _l2norm(q.to(dtype))
    return q / (q.shape[-1] ** 0.5), _l2norm(k.to(dtype))


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Sequence[int], initial_state: Tensor) -> None:
    """Raise ValueError on inconsistent shapes."""
    n, hv, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (n, hv) or g.shape != (n, hv) or beta.shape != (n, hv):
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)}")
    if initial_state.shape != (hv, dk, dv):
        raise ValueError(f"initial_state {tuple(initial_state.shape)} != {(hv, dk, dv)}")
    _check_parents(parents, n)


def gdn_sequential(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Sequence[int],
                   initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: per-node recurrence, node i starts from its parent's state (parents[i] == -1: from initial_state).

    q, k  # [N, HV, dk] raw (l2-normalised here, q also scaled by dk**-0.5, like use_qk_l2norm_in_kernel)
    v     # [N, HV, dv];  g, beta  # [N, HV] (g = log decay <= 0, beta in (0, 1));  initial_state  # [HV, dk, dv]
    returns o [N, HV, dv] and states [N, HV, dk, dv] (state after each node), computed in the dtype of the inputs.
    """
    _check_shapes(q, k, v, g, beta, parents, initial_state)
    n, hv, dk = q.shape
    dtype = q.dtype
    qn, kn = _normalize_qk(q, k, dtype)                                       # [N, HV, dk]
    v, g, beta, s0 = v.to(dtype), g.to(dtype), beta.to(dtype), initial_state.to(dtype)
    states = torch.empty(n, hv, dk, v.shape[-1], dtype=dtype, device=q.device)  # [N, HV, dk, dv]
    o = torch.empty_like(v)                                                   # [N, HV, dv]
    for i, p in enumerate(parents):
        s = (s0 if p < 0 else states[p]) * g[i].exp()[:, None, None]          # decay
        kv_mem = (s * kn[i].unsqueeze(-1)).sum(dim=-2)                        # [HV, dv] = S^T k
        delta = (v[i] - kv_mem) * beta[i].unsqueeze(-1)                       # [HV, dv]
        s = s + kn[i].unsqueeze(-1) * delta.unsqueeze(-2)                     # rank-1 write
        states[i] = s
        o[i] = (s * qn[i].unsqueeze(-1)).sum(dim=-2)                          # [HV, dv] = S^T q
    return o, states


@dataclass(slots=True)
class GDNStash:
    """Per-node data from which gdn_state_at rebuilds any node's state: O(N * HV * (dk + dv)) values."""
    k: Tensor                  # [N, HV, dk] l2-normalised keys (compute dtype)
    v_new: Tensor              # [N, HV, dv] delta-rule corrected values v_new (compute dtype)
    log_decay: Tensor          # [N, HV] float64, c_n = sum of g over anc-or-self(n)
    parents: tuple[int, ...]   # [N]

    def nbytes(self) -> int:
        """Bytes held by the stash tensors."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v_new, self.log_decay))


def _decay_matrix(c: Tensor, hidden: Tensor, dtype: torch.dtype) -> Tensor:
    """Gamma [h, N, N] = exp(c_i - c_j) on ancestor-or-self pairs, 0 elsewhere; c [h, N] float64, hidden = ~ancestor mask."""
    d = c.unsqueeze(-1) - c.unsqueeze(-2)                                    # [h, N, N] float64, <= 0 on ancestors
    return d.masked_fill_(hidden, float("-inf")).exp_().to(dtype)


def _tree_heads(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, c: Tensor, hidden: Tensor, s0: Tensor) -> tuple[Tensor, Tensor]:
    """WY form for h heads: q, k [h, N, dk], v [h, N, dv], beta [h, N], c [h, N] float64, s0 [h, dk, dv] -> o, v_new [h, N, dv]."""
    dv = v.shape[-1]
    gamma = _decay_matrix(c, hidden, q.dtype)                                 # [h, N, N]
    ec = c.exp().to(q.dtype)                                                  # [h, N] e^{c}
    t = (k @ k.transpose(-1, -2)).mul_(gamma).mul_(beta.unsqueeze(-1))       # [h, N, N]; diagonal/upper ignored below
    rhs = torch.cat([v * beta.unsqueeze(-1), k * (beta * ec).unsqueeze(-1)], dim=-1)  # [h, N, dv + dk]
    x = torch.linalg.solve_triangular(t, rhs, upper=False, unitriangular=True)        # T^-1 rhs
    del t, rhs
    v_new = torch.baddbmm(x[..., :dv], x[..., dv:], s0, alpha=-1.0)           # [h, N, dv] = U - W S0
    del x
    att = (q @ k.transpose(-1, -2)).mul_(gamma)                               # [h, N, N]
    del gamma
    o = torch.baddbmm(att @ v_new, q * ec.unsqueeze(-1), s0)                  # [h, N, dv]
    return o, v_new


def gdn_tree(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Sequence[int] | None, initial_state: Tensor,
             head_chunk: int | None = None, ancestors: Tensor | None = None,
             out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, GDNStash]:
    """Outputs of every node with the ancestor-masked chunked (WY/UT) form of hybrid_gdn.md §2.2; same input conventions.

    Computes internally in float32 (float64 if q is float64; cumulative decays always in float64) and returns o [N, HV, dv]
    in q's dtype, plus the stash for gdn_state_at. Memory: O(N^2 * heads_in_flight + N * HV * (dk + dv)); value heads are
    processed in groups of head_chunk (None: as many as keep one [heads, N, N] buffer <= AUTO_HEAD_ELEMENTS elements).
    `ancestors` [N, N] bool (a TreeLayout's) replaces the parents list: no host work, so it runs inside a CUDA graph
    (parents may then be None; the stash has no parents). `out` = (k, v_new, log_decay) buffers the stash is written to.
    """
    if ancestors is None:
        _check_shapes(q, k, v, g, beta, parents, initial_state)
    n, hv, dk = q.shape
    dv = v.shape[-1]
    dtype = fused.compute_dtype(q)
    if head_chunk is None:
        head_chunk = max(1, AUTO_HEAD_ELEMENTS // max(1, n * n))
    if head_chunk < 1:
        raise ValueError(f"head_chunk = {head_chunk} must be >= 1")
    qn, kn = _normalize_qk(q, k, dtype)                                       # [N, HV, dk]
    if ancestors is None:
        c = _path_sum(g.to(torch.float64), parents)                           # [N, HV] float64
        hidden = ~_ancestor_mask(parents, q.device)                           # [N, N] bool, True = not anc-or-self
    else:
        c = ancestors.to(torch.float64) @ g.to(torch.float64)                 # sums over anc-or-self
        hidden = ~ancestors
    s0 = initial_state.to(dtype)                                              # [HV, dk, dv]
    o = torch.empty(n, hv, dv, dtype=q.dtype, device=q.device)                # [N, HV, dv]
    if out is None:
        v_new = torch.empty(n, hv, dv, dtype=dtype, device=q.device)          # [N, HV, dv]
    else:
        out[0].copy_(kn)
        out[2].copy_(c)
        kn, v_new, c = out
    for h0 in range(0, hv, head_chunk):
        hs = slice(h0, min(h0 + head_chunk, hv))
        o_h, v_new_h = _tree_heads(
            qn[:, hs].transpose(0, 1), kn[:, hs].transpose(0, 1),               # [h, N, dk]
            v[:, hs].transpose(0, 1).to(dtype), beta[:, hs].transpose(0, 1).to(dtype),
            c[:, hs].transpose(0, 1), hidden, s0[hs])
        o[:, hs] = o_h.transpose(0, 1)
        v_new[:, hs] = v_new_h.transpose(0, 1)
    return o, GDNStash(k=kn, v_new=v_new, log_decay=c, parents=tuple(parents) if parents is not None else ())


def gdn_state_at(stash: GDNStash, node: int, initial_state: Tensor) -> Tensor:
    """State [HV, dk, dv] after `node` (its root path), from the stash: e^{c_n} S0 + sum_{j in anc-or-self(n)} e^{c_n-c_j} k_j v_new_j^T.

    Returned in the stash's compute dtype (float32, or float64 when gdn_tree ran in float64); node == -1 gives S0.
    """
    dtype = stash.k.dtype
    s0 = initial_state.to(dtype)
    if node < 0:
        return s0.clone()
    path = torch.tensor(_root_path(stash.parents, node), dtype=torch.long, device=stash.k.device)  # [P]
    c = stash.log_decay                                                       # [N, HV] float64
    w = (c[node].unsqueeze(0) - c[path]).exp().to(dtype)                      # [P, HV] e^{c_n - c_j}
    kw = (stash.k[path] * w.unsqueeze(-1)).permute(1, 2, 0)                   # [HV, dk, P]
    vv = stash.v_new[path].transpose(0, 1)                                    # [HV, P, dv]
    return torch.baddbmm(s0 * c[node].exp().to(dtype)[:, None, None], kw, vv)


# ----------------------------------------------------------------------------------------------------------------------
# depthwise causal conv along ancestors


def conv_tree(x: Tensor, parents: Sequence[int] | None, conv_state: Tensor, weight: Tensor,
              window: Tensor | None = None) -> Tensor:
    """Depthwise causal conv (kernel K) + SiLU along each node's ancestors, continuing into the committed inputs.

    x  # [N, C] pre-conv inputs of the tree nodes;  conv_state  # [C, K] last K committed pre-conv inputs, oldest first
    weight  # [C, K] (conv1d.weight.squeeze(1)); node n's window = [x(a_{K-1}), ..., x(parent), x(n)], continuing into
    conv_state's last columns. Accumulates in float32 (float64 for float64 x); returns [N, C] in x's dtype.
    `window` (a TreeLayout's, [N, K]) replaces the parents list (no host work).
    """
    n, ch = x.shape
    kernel = weight.shape[-1]
    if conv_state.shape != (ch, kernel) or weight.shape != (ch, kernel):
        raise ValueError(f"x {tuple(x.shape)} conv_state {tuple(conv_state.shape)} weight {tuple(weight.shape)}")
    if window is None:
        _check_parents(parents, n)
        window = conv_window_index(torch.tensor(list(parents), dtype=torch.long), kernel).to(x.device)
    return fused.conv_windows(x, conv_state, weight, window)   # one gather of the windows, the weighted sum, SiLU


def conv_state_after(x: Tensor, parents: Sequence[int], node: int, conv_state: Tensor) -> Tensor:
    """The conv_state [C, K] after committing the root path ending at `node` (its last K pre-conv inputs, continuing into conv_state)."""
    _check_parents(parents, x.shape[0])
    kernel = conv_state.shape[-1]
    path = _root_path(parents, node)[-kernel:]                                # at most K nodes, oldest first
    tail = x[torch.tensor(path, dtype=torch.long, device=x.device)].transpose(0, 1).to(conv_state.dtype)  # [C, len]
    return torch.cat([conv_state[:, len(path):], tail], dim=1)               # [C, K]


@dataclass(slots=True)
class TreeStash:
    """Every GDN layer's stash of one forward, stacked: the commit of an accepted path is one batched computation
    over all layers (commit_path) instead of one per layer."""
    k: Tensor           # [L, N, HV, dk] l2-normalised keys (compute dtype)
    v_new: Tensor       # [L, N, HV, dv] corrected values (compute dtype)
    log_decay: Tensor   # [L, N, HV] float64 decay sums along root paths
    x: Tensor           # [L, N, C] pre-conv inputs

    @classmethod
    def empty(cls, layers: int, n: int, heads: int, key_dim: int, value_dim: int, channels: int,
              dtype: torch.dtype, x_dtype: torch.dtype, device: torch.device) -> "TreeStash":
        return cls(k=torch.empty(layers, n, heads, key_dim, dtype=dtype, device=device),
                   v_new=torch.empty(layers, n, heads, value_dim, dtype=dtype, device=device),
                   log_decay=torch.empty(layers, n, heads, dtype=torch.float64, device=device),
                   x=torch.empty(layers, n, channels, dtype=x_dtype, device=device))

    def layer(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """gdn_tree's `out` buffers of layer i."""
        return self.k[i], self.v_new[i], self.log_decay[i]


def commit_path(stash: TreeStash, path: Sequence[int], state: Tensor, conv: Tensor) -> None:
    """Commit the root path `path` (node indices, root first) of every layer in place:
    state  # [L, HV, dk, dv] <- the state after path[-1] (gdn_state_at, batched over layers);
    conv   # [L, C, K] <- the last K pre-conv inputs along the path, continuing into conv (conv_state_after)."""
    if not path:
        return
    index = torch.tensor(list(path), dtype=torch.long, device=stash.k.device)   # [P]
    dtype = stash.k.dtype
    c = stash.log_decay[:, index]                                             # [L, P, HV] float64
    last = c[:, -1]                                                           # [L, HV]
    w = (last.unsqueeze(1) - c).exp().to(dtype)                               # [L, P, HV] e^{c_n - c_j}
    layers, p, heads, dk = stash.k.shape[0], index.shape[0], stash.k.shape[2], stash.k.shape[3]
    dv = stash.v_new.shape[-1]
    kw = (stash.k[:, index] * w.unsqueeze(-1)).permute(0, 2, 3, 1).reshape(layers * heads, dk, p)
    vv = stash.v_new[:, index].permute(0, 2, 1, 3).reshape(layers * heads, p, dv)
    s0 = (state.to(dtype) * last.exp().to(dtype)[..., None, None]).reshape(layers * heads, dk, dv)
    state.copy_(torch.baddbmm(s0, kw, vv).view(layers, heads, dk, dv))
    _commit_conv(stash.x, index, conv)


def _commit_conv(x: Tensor, index: Tensor, conv: Tensor) -> None:
    """conv  # [L, C, K] <- its last K pre-conv inputs after the path `index` (x  # [L, N, C]), in place."""
    kernel = conv.shape[-1]
    tail = x[:, index[-kernel:]].transpose(1, 2).to(conv.dtype)              # [L, C, min(P, K)]
    conv.copy_(torch.cat([conv[:, :, tail.shape[-1]:], tail], dim=2))


@dataclass(slots=True)
class ReplayStash:
    """The paths form's stash: every GDN layer's inputs of every node of one forward, from which the accepted path
    is committed by running the chain kernel over it once, all layers at once (layers as heads: replay_path).
    Keys and values are kept as the conv's whole output (q, k, v of a row side by side, as the layer computes it),
    so that a forward can have the conv write into the stash instead of copying k and v there after it."""
    qkv: Tensor    # [L, N, 2 * H * dk + HV * dv] conv outputs: q, k (H key heads, H divides HV), v (HV value heads)
    g: Tensor      # [L, N, HV] float32 log decays
    beta: Tensor   # [L, N, HV]
    x: Tensor      # [L, N, C] pre-conv inputs
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    base: "ReplayStash | None" = None   # a batch's stash of which this one is rows offset.. (replay_batch)
    offset: int = 0

    @property
    def k(self) -> Tensor:
        """[L, N, H, dk] raw keys (a view; the kernel normalises them)."""
        width = self.key_heads * self.key_dim
        return self.qkv[..., width : 2 * width].unflatten(-1, (self.key_heads, self.key_dim))

    @property
    def v(self) -> Tensor:
        """[L, N, HV, dv] values (a view)."""
        return self.qkv[..., 2 * self.key_heads * self.key_dim :].unflatten(-1, (self.value_heads, self.value_dim))

    def put(self, layer: int, qkv: Tensor, g: Tensor, beta: Tensor, x: Tensor) -> None:
        """Stash one GDN layer's inputs of every row (qkv: the conv's output [N, 2 * H * dk + HV * dv])."""
        for buffer, value in ((self.qkv, qkv), (self.g, g), (self.beta, beta), (self.x, x)):
            buffer[layer].copy_(value)

    def rows(self, offset: int, n: int) -> "ReplayStash":
        """A view of rows offset..offset+n (one request's of a batch's stash)."""
        return ReplayStash(*(t[:, offset : offset + n] for t in (self.qkv, self.g, self.beta, self.x)),
                           self.key_heads, self.key_dim, self.value_heads, self.value_dim, base=self, offset=offset)

    @classmethod
    def empty(cls, layers: int, n: int, heads: int, key_dim: int, value_dim: int, channels: int,
              dtype: torch.dtype, device: torch.device, key_heads: int | None = None) -> "ReplayStash":
        key_heads = key_heads or heads
        return cls(qkv=torch.empty(layers, n, 2 * key_heads * key_dim + heads * value_dim, dtype=dtype, device=device),
                   g=torch.empty(layers, n, heads, dtype=torch.float32, device=device),
                   beta=torch.empty(layers, n, heads, dtype=dtype, device=device),
                   x=torch.empty(layers, n, channels, dtype=dtype, device=device),
                   key_heads=key_heads, key_dim=key_dim, value_heads=heads, value_dim=value_dim)


def replay_path(stash: ReplayStash, path: Sequence[int], state: Tensor, conv: Tensor, kernel, in_place=None) -> None:
    """Commit the root path `path` of every layer in place (as commit_path does for a TreeStash): one call of the
    chain kernel (fla's fused recurrent interface) with the L layers' HV heads as L * HV heads of one sequence
    (replay_batch for one request: state  # [L, HV, dk, dv], conv  # [L, C, K]; in_place: its)."""
    if path:
        replay_batch(stash, [path], state[None], conv[None], [0], kernel, in_place)


def replay_columns(lengths: Sequence[int], kernel_size: int, width: int | None = None) -> list[int]:
    """The conv window columns of replay_apply: request i's new window is the last K of [its committed K columns;
    its path's rows], as columns of src = [every request's committed columns (K each); every path row of the batch]
    (each path taking `width` rows where given: padded)."""
    r, columns, start = len(lengths), [], 0
    for i, n in enumerate(lengths):
        for t in range(n, n + kernel_size):   # position t of [committed; path]: a committed column or a path row
            columns.append(i * kernel_size + t if t < kernel_size else r * kernel_size + start + t - kernel_size)
        start += width or n
    return columns


def replay_apply(base: ReplayStash, index: Tensor, cu: Tensor, columns: Tensor, held: Tensor, committed: Tensor,
                 kernel, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The device work of a replay commit, no host reads: (new states [R, L, HV, dk, dv] float32, new conv windows
    [R, L, C, K]) of R requests from their committed states `held` and windows `committed`, by one call of the chain
    kernel over the rows `index` of `base` (one varlen sequence per request, bounds `cu`, all layers as heads).
    valid  # [T] 0/1: a padding row (0) gets zero decay and zero beta, which leave the state exactly as it was."""
    r, (layers, _, heads, dv), dk, total = held.shape[0], base.v.shape, base.k.shape[-1], index.shape[0]

    def as_heads(t: Tensor) -> Tensor:   # [L, N, heads, ...] -> [1, T, L * heads, ...] (layer-major, as GVA groups)
        return t[:, index].transpose(0, 1).reshape(1, total, layers * t.shape[2], *t.shape[3:])

    k, g, beta = as_heads(base.k), as_heads(base.g), as_heads(base.beta)
    if valid is not None:
        g, beta = g * valid[None, :, None].to(g.dtype), beta * valid[None, :, None].to(beta.dtype)
    _, new = kernel(k, k, as_heads(base.v), g=g, beta=beta, initial_state=held.reshape(r, layers * heads, dk, dv).float(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return new.view(r, layers, heads, dk, dv), replay_windows(base, index, columns, committed)


def replay_windows(base: ReplayStash, index: Tensor, columns: Tensor, committed: Tensor) -> Tensor:
    """replay_apply's new conv windows [R, L, C, K]: one gather from [the committed windows; the stash's rows index]."""
    r, layers, _, kernel_size = committed.shape
    src = torch.cat([committed.permute(1, 2, 0, 3).reshape(layers, -1, r * kernel_size),
                     base.x[:, index].transpose(1, 2).to(committed.dtype)], dim=2)    # [L, C, R * K + T]
    window = src[:, :, columns]                                                       # [L, C, R * K]
    return window.view(layers, -1, r, kernel_size).permute(2, 0, 1, 3)


def replay_batch(base: ReplayStash, paths: Sequence[Sequence[int]], states: Tensor, convs: Tensor, slots: Sequence[int],
                 kernel, in_place=None) -> None:
    """Commit R requests' accepted paths whose stashes are rows of one stash `base` (paths: each request's accepted
    path as rows of `base`, root first): one call of the chain kernel for all of them (one varlen sequence per
    request, all layers as heads), their states gathered from and scattered back to the pool (states  # [slots, L,
    HV, dk, dv]), and every conv window [slots, L, C, K] rebuilt by one gather from [committed windows; path rows].
    in_place: our replay kernel (kernels.replay_kernel: tree_kernel.replay_in_place), which walks the paths from the
    pool's states and writes them there, instead of the chain kernel."""
    device, r = base.k.device, len(paths)
    lengths = [len(p) for p in paths]
    host = torch.tensor([row for p in paths for row in p] + list(slots) + np.cumsum([0] + lengths).tolist()
                        + replay_columns(lengths, convs.shape[-1]), dtype=torch.long)
    index, slot_index, cu, columns = to_device(host, device).split([sum(lengths), r, r + 1, r * convs.shape[-1]])   # one copy
    if in_place is not None:
        in_place(base, index, cu, states, slot_index)
        convs.index_copy_(0, slot_index, replay_windows(base, index, columns, convs.index_select(0, slot_index)))
        return
    # slots in a row (the usual case: the engine hands out the lowest free slots) are a view of the pool: no gather
    # (each request's state is 150 MB at Qwen3.6-27B dims), the same traffic as one replay_path per request
    run = list(slots) == list(range(slots[0], slots[0] + r))
    held = states[slots[0] : slots[0] + r] if run else states.index_select(0, slot_index)
    new, window = replay_apply(base, index, cu, columns, held, convs.index_select(0, slot_index), kernel)
    if run:
        held.copy_(new)
    else:
        states.index_copy_(0, slot_index, new.to(states.dtype))
    convs.index_copy_(0, slot_index, window)


def gdn_paths(kernel, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, paths: TreePaths,
              initial_state: Tensor) -> Tensor:
    """Outputs [N, HV, dv] (v's dtype) of every tree node by the paths form: one call of the chain kernel (fla's
    fused recurrent interface, varlen) over all root-to-leaf paths, each from the committed state. Same input
    conventions as gdn_tree (g [N, HV] log decay, beta [N, HV], initial_state [HV, dk, dv]) except that q, k
    [N, H, dk] may have fewer heads (H divides HV; value head j reads key head j // (HV / H))."""
    tokens, dtype = paths.tokens, v.dtype
    states = initial_state.float()[None].expand(paths.num_paths, *initial_state.shape).contiguous()
    o, _ = kernel(q[tokens][None].to(dtype), k[tokens][None].to(dtype), v[tokens][None], g=g[tokens][None].float(),
                  beta=beta[tokens][None].to(dtype), initial_state=states, output_final_state=False,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=paths.cu_seqlens)
    return o[0, paths.node_pos]


def reference_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None,
                        initial_state: Tensor | None = None, output_final_state: bool = False,
                        use_qk_l2norm_in_kernel: bool = True, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """fla's fused_recurrent_gated_delta_rule interface in plain torch (gdn_sequential per sequence): q, k [B, T, H, K]
    (H divides HV), v [B, T, HV, V], g, beta [B, T, HV], initial_state [S, HV, K, V]; varlen with cu_seqlens (B = 1).
    What the CPU tests put in place of the CUDA kernel to check the paths form and the replay commit."""
    assert use_qk_l2norm_in_kernel, "the engine always normalises in the kernel"
    b, t, h, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k = (x.repeat_interleave(hv // h, dim=2) for x in (q, k))
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else None
    seqs = ([(0, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])] if bounds is not None
            else [(i, 0, t) for i in range(b)])
    dtype = fused.compute_dtype(v)
    o = torch.zeros(b, t, hv, dv, dtype=v.dtype, device=v.device)
    finals = []
    for n, (row, lo, hi) in enumerate(seqs):
        s0 = initial_state[n].to(dtype) if initial_state is not None else torch.zeros(hv, dk, dv, dtype=dtype)
        if hi == lo:
            finals.append(s0)
            continue
        out, states = gdn_sequential(*(x[row, lo:hi].to(dtype) for x in (q, k, v, g, beta)), list(range(-1, hi - lo - 1)), s0)
        o[row, lo:hi] = out.to(v.dtype)
        finals.append(states[-1])
    return o, torch.stack(finals).float() if output_final_state else None


__all__ = ["GDNStash", "ReplayStash", "TreeLayout", "TreePaths", "TreeStash", "ancestors_from_parents", "commit_path",
           "conv_state_after", "conv_tree", "conv_window_index", "gdn_paths", "gdn_sequential", "gdn_state_at", "gdn_tree",
           "leaves", "parents_from_visibility", "reference_recurrent", "replay_apply", "replay_batch", "replay_columns",
           "replay_path", "replay_windows", "tree_paths"]
