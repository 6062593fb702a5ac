"""HybridTarget: serving forward for Qwen3.5 / Qwen3.6 text models (Gated DeltaNet + gated attention).

Same contract as DenseTarget.forward (query tokens with positions and an ancestor mask among
themselves), plus: every Gated DeltaNet node starts from its parent's recurrent state and conv
window (ancestors, then the committed state). Three forms compute it (ddtree.models.gdn), all
without per-node state copies: the ancestor-masked WY form (any tree, any device), whose stash
lets `HybridCache.compact(start, accepted)` commit the accepted path's state directly; the paths
form (small trees where fla runs: one fused kernel over the root-to-leaf paths), whose commit
replays the accepted path for all layers in one kernel call; and for rows committed whole (a
prompt, an `ar` step) a chain kernel, committed with the forward.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddtree.models import fused
from ddtree.models.base import TargetModel
from ddtree.models.dense import (
    ForwardPlan,
    KVCache,
    KVPool,
    PackedAttention,
    Segment,
    attend_segments,
    prepare_and_attend,
)
from ddtree.models.gdn import (
    ReplayStash,
    TreeLayout,
    TreePaths,
    TreeStash,
    commit_path,
    conv_state_after,
    conv_tree,
    gdn_paths,
    gdn_state_at,
    gdn_tree,
    parents_from_visibility,
    replay_batch,
    replay_path,
    tree_paths,
)
from ddtree.models.kernels import (
    chain_gdn_kernel,
    conv_steps_kernel,
    conv_windows_kernel,
    gdn_chain_fla,
    gdn_sequences_fla,
    norm_parts,
    replay_kernel,
    step_gdn_kernel,
    steps_gdn_kernel,
    tree_chunk_kernel,
    tree_gates,
    tree_gdn_kernel,
)
from ddtree.models.layers import (
    Derived,
    FusedProjections,
    GatedMLP,
    GatedNormed,
    NormedRows,
    NormFeed,
    Rotary,
    SigmoidGated,
    linear,
    through_gemv,
)
from ddtree.models.loader import assign_weights, load_state_dict, read_config, rope_theta

logger = logging.getLogger(__name__)

HYBRID_TYPES = ("qwen3_5", "qwen3_5_text")
# A long chain (a prompt) goes through the GDN core in pieces of this many tokens: the tree form
# costs O(N^2) memory and O(N^3) for the solve, a chain needs neither beyond a chunk.
PREFILL_CHUNK = 128
# Trees of up to this many rows go through the paths form where a fused chain kernel exists (fla on CUDA): one
# kernel per layer over the root-to-leaf paths instead of ~40 small operations of the ancestor-masked form. Paths
# longer than a DFlash block (never, with a block of 16) stay on the ancestor-masked form. Through fla's kernel
# each path starts from its own copy of the committed state (HV x dk x dv floats: 3 MiB per layer at Qwen3.6-27B
# dims), so larger trees (many leaves) stay on the masked form: measured on an H200 at 27B dims
# (perf/results/gpu_ratios_h200.md, static verify) paths / masked = 25.8 / 27.7 ms at 17 rows, 29.1 / 29.4 at 33,
# 35.6 / 33.1 at 65 (a 64-node tree has ~40 leaves), hence FLA_PATHS_MAX_ROWS. Our kernel (tree_gdn_kernel) reads
# the one committed state in place, so PATHS_MAX_ROWS applies to it. DDTREE_PATHS_MAX_ROWS=0 turns the paths form
# off (perf/gpu_ratios.py measures both).
PATHS_MAX_ROWS = int(os.environ.get("DDTREE_PATHS_MAX_ROWS", "65"))
FLA_PATHS_MAX_ROWS = 33
PATHS_MAX_LEN = 16


@dataclass(slots=True)
class CommittedState:
    """A chunked prefill's result: the state after its last token (commit must accept all of it)."""
    state: torch.Tensor
    conv: torch.Tensor
    last: int


@dataclass(slots=True)
class TreeBatch:
    """Every tree of one forward through our kernels, one call per GDN layer for all of them (the chunk form,
    tree_chunk_kernel: each tree whole; else the paths kernel, tree_gdn_kernel):
    their paths flattened with rows numbered across the batch, each path's recurrent-pool slot, each row's conv
    window as indices into [every request's committed window (K rows each); all rows], and one commit stash for
    all rows (each request's own stash is a view of its rows). Built once per forward, on the device."""
    kernel: object        # tree_gdn_kernel's batched_tree_paths
    slots: torch.Tensor   # [R] long
    tokens: torch.Tensor  # [T] long rows
    first: torch.Tensor   # [S] long
    last: torch.Tensor    # [S] long
    path_state: torch.Tensor   # [S] long slots
    window: torch.Tensor  # [N, K] long
    stash: ReplayStash    # [L, N, ...]
    chunks: object = None               # tree_chunk_kernel's batched_tree_chunks, or None: the paths kernel runs
    row0: torch.Tensor | None = None    # [R] long: each tree's first row (the chunk form's inputs)
    rows: torch.Tensor | None = None    # [R] long: each tree's rows
    ancestors: torch.Tensor | None = None   # [R, M, M] bool: each tree's anc-or-self matrix, padded to the largest
    max_rows: int = 0

    @classmethod
    def of(cls, kernel, segments: list[Segment], layouts: list[TreeLayout], stash: ReplayStash,
           conv_kernel: int) -> "TreeBatch":
        slots = torch.cat([seg.cache.slot_index for seg in segments])
        tokens, first, last, path_state, windows = [], [], [], [], []
        row = tok = 0
        for r, (seg, layout) in enumerate(zip(segments, layouts)):
            paths, window = layout.paths, layout.window
            tokens.append(paths.tokens + row)
            first.append(paths.cu_seqlens[:-1] + tok)
            last.append(paths.cu_seqlens[1:] + tok)
            path_state.append(slots[r : r + 1].expand(paths.num_paths))
            # local window index i < K: the request's committed column i (its block r of the committed rows); else row i - K
            windows.append(torch.where(window < conv_kernel, window + r * conv_kernel,
                                       window + (len(segments) - 1) * conv_kernel + row))
            row, tok = row + seg.length, tok + paths.tokens.shape[0]
        batch = cls(kernel=kernel, slots=slots, tokens=torch.cat(tokens), first=torch.cat(first), last=torch.cat(last),
                    path_state=torch.cat(path_state), window=torch.cat(windows), stash=stash)
        chunks = tree_chunk_kernel(slots.device)
        # the chunk form takes each tree's first row as its root: every tree the engine verifies is rooted there (a
        # static forward's padding rows are roots of their own, their outputs unread)
        if chunks is not None and all(seg.parents is None or min(seg.parents[1:], default=0) >= 0 for seg in segments):
            sizes = [seg.length for seg in segments]
            largest, device = max(sizes), slots.device
            if len(set(sizes)) == 1:   # a static forward: no host data (it is captured)
                batch.row0 = torch.arange(len(sizes), device=device) * largest
                batch.rows = torch.full((len(sizes),), largest, device=device)
                batch.ancestors = torch.stack([layout.ancestors for layout in layouts])
            else:
                batch.row0 = torch.tensor([sum(sizes[:r]) for r in range(len(sizes))], device=device)
                batch.rows = torch.tensor(sizes, device=device)
                batch.ancestors = torch.zeros(len(sizes), largest, largest, dtype=torch.bool, device=device)
                for r, layout in enumerate(layouts):
                    batch.ancestors[r, : sizes[r], : sizes[r]] = layout.ancestors
            batch.chunks, batch.max_rows = chunks, largest
        return batch


@dataclass(frozen=True, slots=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf(cls, hf: dict) -> "HybridConfig":
        text = hf.get("text_config") or hf
        if hf.get("model_type") not in HYBRID_TYPES:
            raise ValueError(f"model_type {hf.get('model_type')!r} is not a Qwen3.5 hybrid {HYBRID_TYPES}")
        layers = text["num_hidden_layers"]
        interval = text.get("full_attention_interval", 4)
        types = text.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                            for i in range(layers)]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        return cls(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
            layer_types=tuple(types), num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text["num_key_value_heads"], head_dim=head_dim, rotary_dim=int(head_dim * factor),
            rope_theta=rope_theta(text), rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            linear_num_key_heads=text["linear_num_key_heads"], linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"], linear_value_head_dim=text["linear_value_head_dim"],
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            tie_word_embeddings=hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
        )

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim


class ZeroCenteredRMSNorm(nn.Module):
    """out = norm(x) * (1 + weight), in float32 (Qwen3.5's RMSNorm; weights start at 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale = Derived(lambda w: 1.0 + w.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.zero_centered_rms_norm(x, self.scale(self.weight), self.eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, norm(x + h)) in one chain; h None: (x, norm(x))."""
        return (x, self(x)) if h is None else fused.add_zero_centered_rms_norm(x, h, self.scale(self.weight), self.eps)

    def prologue(self) -> tuple[str, torch.Tensor]:
        """This norm as a GEMV prologue (ddtree.models.gemv_kernel) and its parameter (the float32 scale)."""
        return "norm", self.scale(self.weight)


class GatedRMSNorm(nn.Module):
    """rmsnorm(o) * weight * silu(z) over each value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return fused.gated_rms_norm(o, z, self.weight, self.eps)


class RecurrentPool:
    """The GDN layers' conv windows and recurrent states of every cache slot: conv [slots, L, C, K] (model dtype),
    state [slots, L, HV, dk, dv] (float32). A slot's HybridCache holds views; a static forward reads and writes a
    slot named by a device index (PooledSlot), so one program serves every slot."""

    def __init__(self, c: HybridConfig, slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        n = sum(t != "full_attention" for t in c.layer_types)
        self.conv = torch.zeros(slots, n, c.conv_dim, c.conv_kernel, dtype=dtype, device=device)
        self.state = torch.zeros(slots, n, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                 dtype=torch.float32, device=device)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [R, C, K], states [R, HV, dk, dv]) of GDN layer `layer` in the slots [R] (device indices)."""
        return self.conv[:, layer].index_select(0, slots), self.state[:, layer].index_select(0, slots)

    def scatter(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Commit the slots' conv windows and states of GDN layer `layer` (the inverse of gather)."""
        self.conv[:, layer].index_copy_(0, slots, conv.to(self.conv.dtype))
        self.state[:, layer].index_copy_(0, slots, state.float())


class HybridCache:
    """Attention K/V for the full-attention layers, conv windows and recurrent states for the GDN layers (views of
    one slot of a RecurrentPool, its own pool of one slot unless one is given)."""

    def __init__(self, c: HybridConfig, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_pool: KVPool | None = None, slot: int = 0, gdn_pool: RecurrentPool | None = None) -> None:
        self.attention_layers = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
        self.gdn_layers = [i for i, t in enumerate(c.layer_types) if t != "full_attention"]
        self.kv = KVCache(len(self.attention_layers), max_len, c.num_key_value_heads, c.head_dim, dtype, device,
                          pool=kv_pool, slot=slot)
        self.max_len = max_len
        self.gdn_pool = gdn_pool or RecurrentPool(c, 1, dtype, device)
        self.slot = slot if gdn_pool is not None else 0
        self.slot_index = torch.tensor([self.slot], dtype=torch.long, device=device)   # the slot as a device index
        self.conv, self.state = self.gdn_pool.conv[self.slot], self.gdn_pool.state[self.slot]
        self.pending: TreeStash | ReplayStash | dict[int, CommittedState] | None = None   # the last forward's
        self.static_stash: ReplayStash | None = None   # pending, where a captured static verify's (graphs.StaticCommit)

    def gdn_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window [C, K], recurrent state [HV, dk, dv]) committed at GDN layer `layer`."""
        return self.conv[layer], self.state[layer]

    def commit_step(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Commit one token at GDN layer `layer` (an `ar` step: the forward is the commit)."""
        self.conv[layer].copy_(conv)
        self.state[layer].copy_(state)

    def reset(self) -> None:
        self.conv.zero_()
        self.state.zero_()
        self.pending = None

    def compact(self, start: int, accepted: list[int]) -> None:
        """Commit the accepted root path (row indices, root first) of the last forward: attention K/V rows, and the
        GDN state and conv window of every layer in one batched computation."""
        self.kv.compact(start, accepted)
        pending, self.pending = self.pending, None
        if isinstance(pending, TreeStash):
            commit_path(pending, accepted, self.state, self.conv)
        elif isinstance(pending, ReplayStash):
            device = self.state.device
            replay_path(pending, accepted, self.state, self.conv, step_gdn_kernel(device), replay_kernel(device))
        elif pending:   # a chunked prefill
            for slot, chain in pending.items():
                assert accepted[-1] == chain.last, f"a chunked prefill commits whole: accepted ends at {accepted[-1]}"
                self.state[slot], self.conv[slot] = chain.state, chain.conv


def compact_all(caches: list[HybridCache], starts: list[int], accepted: list[list[int]]) -> None:
    """HybridCache.compact for several requests of one forward: where every stash is rows of one batch's stash (a
    TreeBatch forward), the K/V rows of all move at once and their recurrent states and conv windows commit in one
    replay (gdn.replay_batch); otherwise per request."""
    stashes = [cache.pending for cache in caches]
    base = stashes[0].base if isinstance(stashes[0], ReplayStash) else None
    pool = caches[0].gdn_pool
    if (len(caches) < 2 or base is None or any(not isinstance(s, ReplayStash) or s.base is not base for s in stashes)
            or any(c.gdn_pool is not pool or c.kv.pool is not caches[0].kv.pool for c in caches)):
        for cache, start, rows in zip(caches, starts, accepted):
            cache.compact(start, rows)
        return
    caches[0].kv.pool.move_rows([(cache.kv.slot, start, rows) for cache, start, rows in zip(caches, starts, accepted)])
    order = sorted(range(len(caches)), key=lambda i: caches[i].slot)   # by slot: consecutive slots replay in place
    replay_batch(base, [[stashes[i].offset + row for row in accepted[i]] for i in order], pool.state, pool.conv,
                 [caches[i].slot for i in order], step_gdn_kernel(pool.state.device), replay_kernel(pool.state.device))
    for cache in caches:
        cache.pending = None


class PooledSlot:
    """A static forward's handle on one request's cache whose slot is a device index (an input of the program), so
    that one captured program serves every slot: GDN reads gather the slot's conv window and state of a layer, an
    `ar` step's commit scatters them back; attention goes through the shared K/V pool (PackedAttention.static)."""

    def __init__(self, template: HybridCache, slot: torch.Tensor) -> None:
        self.gdn_pool, self.kv, self.gdn_layers, self.max_len = template.gdn_pool, template.kv, template.gdn_layers, template.max_len
        self.slot = self.slot_index = slot   # [1] long on the device
        self.pending = None              # the forward's stash (the program returns it for the request's own cache)

    def gdn_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv, state = self.gdn_pool.gather(layer, self.slot)
        return conv[0], state[0]

    def commit_step(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.gdn_pool.scatter(layer, self.slot, conv[None], state[None])


class GatedAttention(FusedProjections, nn.Module):
    PROJECTIONS = ("q_proj", "k_proj", "v_proj")    # q_proj holds q and its output gate

    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rotary_dim = c.rotary_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: list[Segment],
                slot: int, packed: PackedAttention | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's attention output [plus the residual stream, added in o_proj's epilogue]."""
        n = x.shape[0]
        q_gate, k, v = self.project(x)
        q, gate = q_gate.reshape(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k, v = k.reshape(n, self.num_kv_heads, self.head_dim), v.reshape(n, self.num_kv_heads, self.head_dim)
        # norms, rotary and the K/V writes in one kernel where it runs (packed forwards on CUDA)
        norms = (self.q_norm.scale(self.q_norm.weight), self.k_norm.scale(self.k_norm.weight), self.q_norm.eps, True)
        out = prepare_and_attend(q, k, v, norms, rope, [seg.cache.kv for seg in segments], slot, self.head_dim**-0.5,
                                 packed)
        if out is not None:
            return linear(SigmoidGated(out.reshape(n, -1), gate), self.o_proj, residual)
        # per-head norm, then rotary over the first rotary_dim dims (cos, sin are that wide): one chain each
        q = fused.zero_centered_norm_partial_rotary(q, self.q_norm.scale(self.q_norm.weight), self.q_norm.eps, *rope)
        k = fused.zero_centered_norm_partial_rotary(k, self.k_norm.scale(self.k_norm.weight), self.k_norm.eps, *rope)
        out = attend_segments(q, k, v, [seg.cache.kv for seg in segments], segments, slot, self.head_dim**-0.5, packed)
        return linear(SigmoidGated(out.reshape(n, -1), gate), self.o_proj, residual)


def value_heads(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k  # [N, key heads, dk] -> [N, heads, dk]: each key head serves heads / key heads value heads in turn."""
    repeat = heads // q.shape[1]
    return q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)


class GatedDeltaNet(FusedProjections, nn.Module):
    PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")   # pre-conv q/k/v, gate z, beta, decay

    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.c = c
        key_dim, value_dim = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        self.key_dim, self.value_dim = key_dim, value_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(c.linear_num_value_heads))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, c.hidden_size, bias=False)
        self.decay_rate = Derived(lambda a_log: -a_log.float().exp())        # g = decay_rate * softplus(a + dt_bias)
        self.conv_weight = Derived(lambda w: w.squeeze(1).to(fused.compute_dtype(w)))

    def forward(self, x: torch.Tensor, segments: list[Segment], slot: int, layouts: list[TreeLayout],
                stashes: list[TreeStash | ReplayStash | None], trees: TreeBatch | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of several sequences, packed: the projections, gates, output norm and out_proj over all rows at once
        (each weight read once per forward, whatever the batch); the conv and the recurrence of a batch of `ar`
        steps (`_steps`) or of trees through our paths kernel (`_trees`) for all sequences at once, else per
        sequence, from its own committed state (`_core`)."""
        c, n = self.c, x.shape[0]
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        mixed, z, b, a = self.project(x)                                     # mixed  # [n, conv_dim] pre-conv
        if trees is not None:   # the gates go straight into the batch's commit stash (no copies after them)
            beta, g = trees.stash.beta[slot], trees.stash.g[slot]
            gates = (b, a, self.decay_rate(self.A_log), self.dt_bias, beta, g)
            if not (tree_gates() and conv_windows_kernel(x.device) is not None):
                fused.gdn_gates_into(*gates)
                gates = None   # else computed by the conv's kernel (kernels.tree_gates)
            o = self._trees(mixed, g, beta, segments[0].cache.gdn_pool, slot, trees, gates)
        else:
            o = self._sequences(mixed, b, a, segments, slot, layouts, stashes)
        return linear(GatedNormed(self.norm, o.reshape(n, hv * dv).to(x.dtype), z, dv), self.out_proj, residual)

    def _sequences(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, segments: list[Segment], slot: int,
                   layouts: list[TreeLayout], stashes: list[TreeStash | ReplayStash | None]) -> torch.Tensor:
        """A batch of `ar` steps in one pass (`_steps`; a lone step too where our kernel runs them in place), else each
        sequence from its own committed state (`_core`). b, a: the gates' raw projections [n, hv]."""
        one_pool = len({id(seg.cache.gdn_pool) for seg in segments}) == 1
        several = len(segments) > 1 or steps_gdn_kernel(mixed.device) is not None
        if several and mixed.shape[0] == len(segments) and all(s is None for s in stashes) and one_pool:
            return self._steps(mixed, b, a, segments, slot)
        beta, g = fused.gdn_gates(b, a, self.decay_rate(self.A_log), self.dt_bias)   # [n, hv]; g float32
        outputs, row = [], 0
        for seg, layout, stash in zip(segments, layouts, stashes):
            rows = slice(row, row + seg.length)
            outputs.append(self._core(mixed[rows], g[rows], beta[rows], seg.cache, slot, layout, stash))
            row += seg.length
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _core(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cache: HybridCache, slot: int,
              layout: TreeLayout, stash: TreeStash | ReplayStash | None) -> torch.Tensor:
        """One sequence's conv and recurrence: o [n, HV, dv]. A tree is committed later from `stash`; without a stash,
        rows committed whole: one token (an `ar` step or a one-token prompt: its state and conv window are committed
        here) or a long prompt (run in chunks; committed by compact)."""
        n = mixed.shape[0]
        window, state = cache.gdn_state(slot)                               # committed conv window and state
        conv = conv_tree(mixed, None, window, self.conv_weight(self.conv1d.weight), window=layout.window)
        q, k, v = self._heads(conv)
        if stash is None and n == 1:
            o, new_state = self._step(q, k, v, g, beta, state)
            cache.commit_step(slot, fused.shifted_window(window, mixed), new_state)
        elif stash is None:
            o, new_state = self._chunked_chain(q, k, v, g, beta, state)
            conv_state = conv_state_after(mixed, list(range(-1, n - 1)), n - 1, window)
            cache.pending[slot] = CommittedState(state=new_state, conv=conv_state, last=n - 1)
        elif layout.paths is not None:   # the paths form through fla (ours runs in _trees); the commit replays the path
            o = gdn_paths(step_gdn_kernel(q.device), q, k, v, g, beta, layout.paths, state)
            stash.put(slot, conv, g, beta, mixed)
        else:
            o, _ = gdn_tree(*value_heads(q, k, v.shape[1]), v, g, beta, None, state, ancestors=layout.ancestors,
                            out=stash.layer(slot))
            stash.x[slot].copy_(mixed)
        return o

    def _trees(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: "RecurrentPool", slot: int,
               trees: TreeBatch, gates: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Every tree of the forward at GDN layer `slot` (TreeBatch): one conv over all rows (each window into its own
        request's committed one) that writes its output and its inputs into the batch's commit stash (g and beta are
        there already: forward), one call of our chunk kernel (each tree whole from its slot's state, read in place)
        or of our paths kernel (each path from it). The same values as `_core` computes for each tree alone. gates: g
        and beta not yet computed, their inputs for the conv's kernel (kernels.tree_gates)."""
        qkv = trees.stash.qkv[slot]   # the committed windows read from the pool by the conv's kernel (column r * K + i)
        conv = conv_windows_kernel(mixed.device) or fused.conv_windows_pooled_into
        conv(mixed, pool.conv[:, slot], trees.slots, self.conv_weight(self.conv1d.weight), trees.window, qkv,
             trees.stash.x[slot], **({} if gates is None else {"gates": gates}))
        q, k, v = self._heads(qkv)
        if trees.chunks is not None:
            return trees.chunks(q, k, v, g, beta, trees.row0, trees.rows, trees.ancestors, pool.state[:, slot],
                                trees.slots, trees.max_rows, PATHS_MAX_LEN)
        return trees.kernel(q, k, v, g, beta, trees.tokens, trees.first, trees.last, pool.state[:, slot], trees.path_state)

    def _steps(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, segments: list[Segment],
               slot: int) -> torch.Tensor:
        """One committed token for each of R sequences at GDN layer `slot`: on CUDA with our kernels, one conv that
        reads the committed windows from the pool and shifts them there (conv_steps_kernel) and one call that
        computes the gates from b, a and reads and writes each state in place (steps_in_place); else their states
        gathered from the pool, one conv and (on CUDA) one fla call for all, the new states scattered back. Per
        sequence the same values as `_core` computes for it alone (the torch recurrence runs per sequence; the kernels'
        programs are per sequence)."""
        pool = segments[0].cache.gdn_pool
        slots = segments[0].cache.slot_index if len(segments) == 1 else torch.cat([s.cache.slot_index for s in segments])
        in_place = steps_gdn_kernel(mixed.device)
        if in_place is not None:
            conv_in_place = conv_steps_kernel(mixed.device)
            if conv_in_place is not None:
                conv = conv_in_place(mixed, pool.conv[:, slot], slots, self.conv_weight(self.conv1d.weight))
            else:
                conv, shifted = fused.conv_steps_pooled(mixed, pool.conv[:, slot], slots, self.conv_weight(self.conv1d.weight))
                pool.conv[:, slot].index_copy_(0, slots, shifted)
            q, k, v = self._heads(conv)
            return in_place(q, k, v, b, a, self.decay_rate(self.A_log), self.dt_bias, pool.state[:, slot], slots)
        beta, g = fused.gdn_gates(b, a, self.decay_rate(self.A_log), self.dt_bias)   # [n, hv]; g float32
        conv_states, states = pool.gather(slot, slots)
        conv, shifted = fused.conv_steps(mixed, conv_states, self.conv_weight(self.conv1d.weight))
        q, k, v = self._heads(conv)
        kernel = step_gdn_kernel(mixed.device)
        if kernel is not None:   # the sequences as fla's batch: [R, 1, ...]
            o, new_states = gdn_sequences_fla(kernel, q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], states)
            o = o[:, 0]
        else:
            steps = [self._step(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], states[i])
                     for i in range(mixed.shape[0])]
            o, new_states = torch.cat([s[0] for s in steps]), torch.stack([s[1] for s in steps])
        pool.scatter(slot, slots, shifted, new_states)
        return o

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [n, key heads, dk] and v [n, HV, dv] of the conv output [n, conv_dim]: q, k keep their key heads
        (fla's kernels group value heads onto them, GVA; the torch forms repeat them)."""
        c, n = self.c, conv.shape[0]
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        heads, dk = c.linear_num_key_heads, c.linear_key_head_dim
        return q.reshape(n, heads, dk), k.reshape(n, heads, dk), v.reshape(n, c.linear_num_value_heads, c.linear_value_head_dim)

    @staticmethod
    def _step(q, k, v, g, beta, state):
        """One token from the committed state: fla's fused recurrent kernel on CUDA where installed, else torch."""
        kernel = step_gdn_kernel(q.device)
        if kernel is not None:
            return gdn_chain_fla(kernel, q, k, v, g, beta, state)
        o, stash = gdn_tree(*value_heads(q, k, v.shape[1]), v, g, beta, [-1], state)
        return o, gdn_state_at(stash, 0, state)

    @staticmethod
    def _chunked_chain(q, k, v, g, beta, state):
        """A committed chain: fla's chunked kernel on CUDA where installed, else torch in PREFILL_CHUNK pieces,
        each starting from the previous piece's final state."""
        kernel = chain_gdn_kernel(q.device)
        if kernel is not None:
            return gdn_chain_fla(kernel, q, k, v, g, beta, state)
        q, k = value_heads(q, k, v.shape[1])
        outputs = []
        for s in range(0, q.shape[0], PREFILL_CHUNK):
            e = min(s + PREFILL_CHUNK, q.shape[0])
            chain = list(range(-1, e - s - 1))
            o, stash = gdn_tree(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], chain, state)
            state = gdn_state_at(stash, e - s - 1, state)
            outputs.append(o)
        return torch.cat(outputs), state


class HybridLayer(nn.Module):
    def __init__(self, c: HybridConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "full_attention":
            self.self_attn = GatedAttention(c)
        else:
            self.linear_attn = GatedDeltaNet(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)


class HybridTarget(TargetModel):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(config, kind) for kind in config.layer_types)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    def fuse_projections(self) -> None:
        """Each layer's input projections as one, and gate/up as one (after loading the checkpoint's names)."""
        for layer in self.layers:
            (layer.self_attn if layer.kind == "full_attention" else layer.linear_attn).fuse()
            layer.mlp.fuse()

    def new_cache(self, max_len: int) -> HybridCache:
        return self.new_caches(1, max_len)[0]

    def new_caches(self, slots: int, max_len: int) -> list[HybridCache]:
        """One cache per slot; their attention K/V share one KVPool (packed attention for all slots at once)."""
        c, p = self.config, self.embed_tokens.weight
        pool = KVPool(c.layer_types.count("full_attention"), slots, max_len, c.num_key_value_heads, c.head_dim,
                      p.dtype, p.device)
        gdn_pool = RecurrentPool(c, slots, p.dtype, p.device)
        return [HybridCache(c, max_len, p.dtype, p.device, kv_pool=pool, slot=i, gdn_pool=gdn_pool) for i in range(slots)]

    def uses_paths(self, rows: int, device: torch.device) -> bool:
        """Whether a tree of `rows` rows on `device` goes through the paths form (PATHS_MAX_ROWS; FLA_PATHS_MAX_ROWS
        at most where fla's kernel runs it)."""
        if step_gdn_kernel(device) is None:
            return False
        return 1 < rows <= (PATHS_MAX_ROWS if tree_gdn_kernel(device) is not None else min(PATHS_MAX_ROWS, FLA_PATHS_MAX_ROWS))

    def free_padding_paths(self, device: torch.device) -> bool:
        """Whether padding paths cost (next to) nothing in the paths form on `device`: our kernel runs it (a padding
        path's programs read their bounds and end); fla's kernel copies a state per path, padding ones too."""
        return tree_gdn_kernel(device) is not None

    @staticmethod
    def _committed_whole(seg: Segment, device: torch.device) -> bool:
        """Rows committed whole, which need no stash: one token (committed in place) or a prompt (a chain from an
        empty cache: chunked where long, through fla wherever it runs). seg.parents is None in a static forward."""
        if seg.length == 1:
            return True
        return seg.parents == list(range(-1, seg.length - 1)) and (
            seg.length > PREFILL_CHUNK or (seg.start == 0 and chain_gdn_kernel(device) is not None))

    def plan(self, segments: list[Segment]) -> ForwardPlan:
        """The eager forward's structure: packed attention and one TreeLayout per segment (one small host-to-device
        copy of its parents, and of its paths where the paths form runs; the ancestors are the segment's own mask)."""
        layouts = []
        for seg in segments:
            if seg.parents is None:
                seg.parents = parents_from_visibility(seg.mask[:, seg.start :].cpu())
            device = seg.mask.device
            host = [torch.tensor(seg.parents, dtype=torch.long)]
            tree = not self._committed_whole(seg, device) and self.uses_paths(seg.length, device)
            paths = tree_paths(seg.parents, PATHS_MAX_LEN) if tree else None
            if paths is not None:
                host += [torch.from_numpy(a) for a in paths]
            parts = torch.cat(host).to(device).split([t.shape[0] for t in host])
            layouts.append(TreeLayout.of(parts[0], self.config.conv_kernel, ancestors=seg.mask[:, seg.start :],
                                         paths=TreePaths(*parts[1:]) if paths is not None else None))
        return ForwardPlan(PackedAttention.plan([seg.cache.kv for seg in segments], segments), layouts)

    def _tree_batch(self, segments: list[Segment], layouts: list[TreeLayout], x: torch.Tensor) -> TreeBatch | None:
        """The forward's TreeBatch where every segment is a tree on the paths form, our kernel runs and all share
        one recurrent pool; else None (each sequence on its own, `_core`)."""
        kernel = tree_gdn_kernel(x.device)
        if kernel is None or any(layout.paths is None for layout in layouts) or len({id(seg.cache.gdn_pool) for seg in segments}) != 1:
            return None
        c = self.config
        stash = ReplayStash.empty(len(segments[0].cache.gdn_layers), x.shape[0], c.linear_num_value_heads,
                                  c.linear_key_head_dim, c.linear_value_head_dim, c.conv_dim, x.dtype, x.device,
                                  key_heads=c.linear_num_key_heads)
        return TreeBatch.of(kernel, segments, layouts, stash, c.conv_kernel)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                       tap_layers: list[int] | None = None, logit_rows: torch.Tensor | None = None,
                       plan: ForwardPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sequences' rows in one pass; attention and GDN run per sequence on its own cache. A given `plan`
        (a static forward's) means no host work at all: each segment is a tree to verify (one row: a step)."""
        if plan is None:
            for seg in segments:
                if seg.start == 0:
                    seg.cache.reset()   # a new sequence: no committed recurrent state
            plan = self.plan(segments)
        c, x = self.config, self.embed_tokens(input_ids)
        trees = self._tree_batch(segments, plan.layouts, x)
        stashes, row = [], 0
        for seg, layout in zip(segments, plan.layouts):
            shape = (len(seg.cache.gdn_layers), seg.length, c.linear_num_value_heads, c.linear_key_head_dim,
                     c.linear_value_head_dim, c.conv_dim)
            if self._committed_whole(seg, x.device):
                stashes.append(None)
            elif trees is not None:   # a view of the batch's one stash
                stashes.append(trees.stash.rows(row, seg.length))
            elif layout.paths is not None:
                stashes.append(ReplayStash.empty(*shape, x.dtype, x.device, key_heads=c.linear_num_key_heads))
            else:
                stashes.append(TreeStash.empty(*shape, fused.compute_dtype(x), x.dtype, x.device))
            seg.cache.pending = stashes[-1] or {}
            row += seg.length
        rope = self.rotary(positions, x.dtype)
        taps, wanted = {}, set(tap_layers or ())
        attn_slot = gdn_slot = 0
        pending = None   # the last MLP's output, added to x in the next norm's chain
        # rows through our kernels (an `ar` step, a few rows: layers.through_gemv): each norm computed by the Linear
        # that reads it (one row: in the GEMV's prologue), each residual add in the epilogue of the Linear before it
        # (ddtree.models.gemv_kernel), the stream x always whole
        gemv = through_gemv(x)
        # kernels.norm_parts: each norm but the first and the final one taken in the epilogues of the products around it
        parts, feed = gemv and norm_parts(), None
        for i, layer in enumerate(self.layers):
            if gemv:
                h = NormedRows(layer.input_layernorm, x, feed)
            else:
                x, h = layer.input_layernorm.add_norm(x, pending)
            residual = x if gemv else None   # added in the mixer's output projection
            if parts:
                residual = NormFeed(x, layer.post_attention_layernorm)
            if layer.kind == "full_attention":
                h = layer.self_attn(h, rope, segments, attn_slot, plan.packed, residual)
                attn_slot += 1
            else:
                h = layer.linear_attn(h, segments, gdn_slot, plan.layouts, stashes, trees, residual)
                gdn_slot += 1
            if gemv:   # h: the stream with the mixer's output added
                fed = residual if parts else None
                feed = NormFeed(h, self.layers[i + 1].input_layernorm) if parts and i + 1 < len(self.layers) else None
                x = layer.mlp(NormedRows(layer.post_attention_layernorm, h, fed), h if feed is None else feed)
            else:
                x, h = layer.post_attention_layernorm.add_norm(x, h)
                pending = layer.mlp(h)
            if i in wanted:
                x, pending = (x if pending is None else x + pending), None
                taps[i] = x
        return self.outputs(x if pending is None else x + pending, taps, tap_layers, logit_rows)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str = "cpu") -> "HybridTarget":
        config = HybridConfig.from_hf(read_config(path))
        with torch.device("meta"):
            model = cls(config)
        state = {}
        for key, tensor in load_state_dict(path, desc=f"loading target {Path(path).name}").items():
            if key.startswith(("mtp.", "model.visual.")):
                continue
            name = key.removeprefix("model.language_model.").removeprefix("model.")
            state[name] = tensor
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        assign_weights(model, state, path)
        model.fuse_projections()
        model.rotary = Rotary(config.rotary_dim, config.rope_theta)
        logger.info("target %s: qwen3_5 hybrid, %d layers (%d GDN), hidden %d, vocab %d", Path(path).name,
                    config.num_hidden_layers, sum(t != "full_attention" for t in config.layer_types),
                    config.hidden_size, config.vocab_size)
        return model.to(device=device, dtype=dtype).eval()
