"""Optional fused GPU kernels, looked up lazily and only for CUDA tensors.

fla (flash-linear-attention) imports triton at import time; on a CPU machine where triton is
installed, importing it breaks transformers' model selection. So nothing here imports fla unless a
CUDA tensor asks for it, and `DDTREE_DISABLE_FLA=1` forces the plain torch path everywhere (the
reference the kernels are tested against, tests/gpu/test_fla_path.py).

Where fla applies: a chain whose whole result is committed (a prompt's prefill), through
`chunk_gated_delta_rule`; a one-token step (an `ar` round), through `fused_recurrent_gated_delta_rule`;
and small trees (a dflash chain too, whose accepted prefix is only known after the verify) over their
root-to-leaf paths: through our kernel (ddtree.models.tree_kernel, all requests' paths in one call, no
state copies; by default each tree whole in the chunk form, tree_chunk_kernel), or the same fla kernel per request
(ddtree.models.gdn.gdn_paths) where ours is off. fla has no ancestor-masked form: larger trees, and everything off
CUDA, stay on ddtree.models.gdn.gdn_tree.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _fla_chunk_gdn() -> Callable | None:
    if os.environ.get("DDTREE_DISABLE_FLA", "") not in ("", "0"):
        logger.info("fla disabled by DDTREE_DISABLE_FLA: Gated DeltaNet prefill runs in plain torch")
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:   # the CPU image, or a GPU machine without the package
        logger.info("fla not available (%s): Gated DeltaNet prefill runs in plain torch", exc)
        return None
    logger.info("Gated DeltaNet prefill uses fla.ops.gated_delta_rule.chunk_gated_delta_rule")
    return chunk_gated_delta_rule


@functools.cache
def _fla_fused_recurrent() -> Callable | None:
    if _fla_chunk_gdn() is None:        # disabled or missing: logged there
        return None
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    return fused_recurrent_gated_delta_rule


def pdl(device: torch.device) -> bool:
    """Whether our Triton kernels launch on `device` with Programmatic Dependent Launch (PDL, Hopper sm90+): each
    launched with launch_pdl (the CUDA launch attribute programmatic stream serialization), so it may start while the
    kernel before it in the stream finishes, and inside, once it has loaded what it may (read-only weights),
    tl.extra.cuda.gdc_wait() (until the previous grid has completed and its writes are visible) and
    tl.extra.cuda.gdc_launch_dependents() (the next PDL launch may start once every program of this grid called it
    or exited). In a CUDA-graph-captured forward (hundreds of small kernels back to back) a kernel's launch and its
    first weight loads then overlap the previous kernel's tail. Each kernel keeps to these rules, which make it
    race-free whatever launches before or after it (ddtree.models.grid_wait's wait_for_previous_grid makes the wait):
    1. every program calls gdc_wait() unconditionally (no early return before it), before any load of a buffer that
       another kernel writes (activations, K/V caches, recurrent and conv state pools, tree inputs, scratch) and
       before any store; only loads of read-only weights (model parameters) may come before it;
    2. gdc_launch_dependents() right after gdc_wait(), never before it (a kernel launched early can then only run past
       its own wait once every grid before it has completed: the chain's transitivity rests on it);
    3. with PDL off a kernel's code and launch are those without it (the PDL constexpr False).
    True only where DDTREE_PDL is set (not "" or "0"), read at each launch (a CUDA graph captured while it is set
    holds PDL launches), and `device` is a CUDA device of compute capability 9 or more; the compiled chains
    (ddtree.models.fused) follow it too. Off by default: on an H100 at 27B dims it made the `ar` and `dflash` rounds
    0.986x and 0.967x, but `ddtree-16`'s 1.075x (perf/results/gpu_ratios_h100_pdl.md; gpu_ratios' variants static-pdl
    and static-pdlwait)."""
    if os.environ.get("DDTREE_PDL", "") in ("", "0") or device.type != "cuda":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def tree_gdn_kernel(device: torch.device) -> Callable | None:
    """Our Triton kernel for the paths form (ddtree.models.tree_kernel.batched_tree_paths: every request's paths in one
    call, each from its own committed state, read in place) on `device`, or None: CUDA only, where fla runs (the
    commit replays the accepted path through it); DDTREE_TREE_KERNEL=0 falls back to fla's kernel per request
    (gdn.gdn_paths). Measured at 27B dims on an H200 (perf/results/tree_kernel_h200.md): 2.4-4.4x faster than fla's
    form at one request, 4-6x at 4-8."""
    if device.type != "cuda" or os.environ.get("DDTREE_TREE_KERNEL", "1") in ("", "0") or step_gdn_kernel(device) is None:
        return None
    return _tree_kernel()


def tree_build_kernel(device: torch.device) -> Callable | None:
    """A static tree program's body in two Triton launches (ddtree.models.tree_build_kernel.tree_program: the tree,
    equal to tree.device.build_tree_device, then verify_rows' head and tree_paths_device's paths; their tensor forms
    take ~300 small kernels, ~0.4 ms of the H200 a round) on CUDA unless DDTREE_TREE_BUILD_KERNEL=0, else None. On
    the H200 in 5 turns the draft stage's GPU timeline was 2.4 ms against 2.9 and the rounds against their own `ar`
    ddtree-16 1.355 / dflash 1.286 against 1.369 / 1.301, ddtree-64 equal (perf/results/gpu_ratios_h200_treeturns.md)."""
    if device.type != "cuda" or os.environ.get("DDTREE_TREE_BUILD_KERNEL", "1") in ("", "0"):
        return None
    return _tree_build_kernel()


def draft_top_kernel(device: torch.device) -> Callable | None:
    """The draft's log-probabilities' top k in a tree program (graphs.StaticTreeBuild) in two Triton launches
    (ddtree.models.tree_build_kernel.draft_top_k) instead of log_softmax then torch.topk (~20 kernels: 0.157 ms of
    the 1.019 of a `ddtree-16` draft's eager tail on an H100 besides the lm_head, perf/results/gpu_ratios_h100_keys.md)
    on CUDA with DDTREE_DRAFT_TOP_KERNEL=1, else None. Off by default: measured, not faster (whole 27B rounds on an
    H100 0.994 / 0.995 / 0.997x and 0.995 / 1.003 / 1.002x, perf/results/gpu_ratios_h100_drafttop{2,3}.md)."""
    if device.type != "cuda" or os.environ.get("DDTREE_DRAFT_TOP_KERNEL", "0") in ("", "0"):
        return None
    return _draft_top_kernel()


@functools.cache
def _draft_top_kernel() -> Callable:
    from ddtree.models.tree_build_kernel import draft_top_k
    return draft_top_k


def tree_build_scratch(depth: int, width: int, grid_size: int, device: torch.device):
    """tree_build_kernel's scratch for one program shape (made before its capture)."""
    from ddtree.models.tree_build_kernel import TreeBuildScratch
    return TreeBuildScratch(depth, width, grid_size, device)


@functools.cache
def _tree_build_kernel() -> Callable:
    from ddtree.models.tree_build_kernel import tree_program
    return tree_program


def tree_chunk_kernel(device: torch.device) -> Callable | None:
    """Our Triton kernel for whole trees in the ancestor-masked chunk form (ddtree.models.tree_kernel.
    batched_tree_chunks: per tree, value head and block of columns, the root as one step, the rest as matrix products
    on tensor cores; no path walks, shared prefixes computed once) where tree_gdn_kernel runs, else None:
    DDTREE_TREE_CHUNKS=0 keeps tree_gdn_kernel's paths. On the H200 at 27B dims a round's trees took 0.58 / 1.66 ms
    at budget 16 / 64 through it against 0.82 / 2.43 through the paths (perf/results/gpu_ratios_h200_chunks.md)."""
    if tree_gdn_kernel(device) is None or os.environ.get("DDTREE_TREE_CHUNKS", "1") in ("", "0"):
        return None
    return _chunk_kernel()


@functools.cache
def _chunk_kernel() -> Callable:
    from ddtree.models.tree_kernel import batched_tree_chunks
    return batched_tree_chunks


def gemv_kernel(device: torch.device) -> Callable | None:
    """Our one-row matrix products with the chain before each in their prologue (ddtree.models.gemv_kernel.linear_rows)
    on CUDA, or None (cuBLAS through F.linear, the chains apart): DDTREE_GEMV_KERNEL=0 turns it off. On the H200 a
    27B step's Linears took 12.13 ms through it plain and 12.73 with the chains in it, against 13.03 through
    cuBLASLt without them (the floor at copy bandwidth 12.09; perf/results/gemv_h200_prologues_partial.log)."""
    if device.type != "cuda" or os.environ.get("DDTREE_GEMV_KERNEL", "1") in ("", "0"):
        return None
    return _gemv_kernel()


def rows_glu() -> bool:
    """Whether static forwards of a few rows take a gated MLP's silu(gate) * up in the epilogue of its fused gate/up
    product (gemv_kernel.linear_rows' glu) instead of the chain's own kernel after it (64 of them in a 27B verify, and
    the [rows, 2 x 17408] product written and read again); on by default, DDTREE_ROWS_GLU=0 turns it off. With
    tree_gates, whole 27B rounds 0.991 / 0.980 / 0.988x (`ddtree-16` / `ddtree-64` / `dflash`) those without both on
    an H200 (perf/results/gpu_ratios_h200_k64default.md, 3d40a11), 0.986 / 0.998 / 0.990x on an H100
    (gpu_ratios_h100_k64default.md). On since a GPU test's one failure with both at 0fd61e1 did not come back in that
    test's order or in 260 requests of its scenario (README, "The GLU form and the gates, on by default")."""
    return os.environ.get("DDTREE_ROWS_GLU", "1") not in ("", "0")


def norm_parts() -> bool:
    """Whether static forwards of a few rows of a hybrid target take each zero-centered RMSNorm of the residual stream
    (but the first layer's and the final one) across the products around it, with no kernel of its own: the product
    that adds into the stream (o_proj, out_proj, down_proj) also writes y = h * scale and each program's sums of h^2
    per row in its epilogue, and the product reading the norm (the mixer's input projections, gate/up) multiplies y
    and divides each row by rms(h) in its epilogue (gemv_kernel.linear_rows' norm_out, norm_in; layers.NormFeed).
    127 norm kernels less a 27B verify (their ~2.7 us each on an H100: 118 `fused_rms_norm` kernels a `ddtree-16`
    round, 0.32 ms, perf/results/gpu_ratios_h100_pdl2.md). The norm's input is y rounded before the product instead
    of the normalized row rounded (the one-row GEMV's prologue never rounds it either). On by default
    (DDTREE_NORM_PARTS=0 turns it off): whole 27B rounds on an H100 with the partial sums read before the reading
    product's loop, two runs of 3 turns against it off, 0.993 / 0.992 / 0.989x and 0.990 / 0.986 / 1.002x (`dflash` /
    `ddtree-16` / `ddtree-64`; perf/results/gpu_ratios_h100_drafttop{2,3}.md, 0d7f4dc)."""
    return os.environ.get("DDTREE_NORM_PARTS", "1") not in ("", "0")


def gemv_max_rows() -> int:
    """The most rows of a static forward whose Linears go through our kernels (gemv_kernel: one row through the GEMV,
    up to this many through its few-rows kernel, which streams each weight once for all of them); more go through
    cuBLAS. DDTREE_GEMV_ROWS, default 17: a drafter's block, a dflash verify, a batch of up to 17 `ar` steps (the 27B
    step's products on the H200 at 16 rows 12.86 ms against cuBLASLt's 13.56, at 4 12.66 against 13.46:
    perf/results/gemv_rows_h200_4_16.md) and a budget-16 tree's 17 rows, through the kernel's swapped form
    (gemv_kernel.swap_ab): its whole `ddtree-16` round 0.981x the round with those rows on cuBLAS, in each of 3 turns
    0.980-0.995 (perf/results/gpu_ratios_h200_rowpro.md, `static-swap32`; the products alone 1% faster,
    gemv_rows_h200_17.md). At 65 cuBLAS is faster. 16: 17 rows on cuBLAS; 1: the GEMV alone."""
    return max(1, min(int(os.environ.get("DDTREE_GEMV_ROWS", "17") or "1"), 128))


@functools.cache
def _gemv_kernel() -> Callable:
    from ddtree.models.gemv_kernel import linear_rows
    logger.info("one-row Linears in static forwards use ddtree.models.gemv_kernel")
    return linear_rows


# query rows per request our attention kernel takes at most (trees); longer ones (prompts) go through PyTorch's SDPA
ATTENTION_KERNEL_MAX_ROWS = 128


def attention_kernel(device: torch.device) -> Callable | None:
    """Our split-KV masked attention for a forward's few query rows per request (ddtree.models.attention_kernel) on
    CUDA, or None (PyTorch's scaled_dot_product_attention); for how many rows (0 where DDTREE_ATTENTION_KERNEL turns
    it off): attention_kernel_rows, which callers check first."""
    if device.type != "cuda":
        return None
    return _attention_kernel()


def attention_kernel_rows(head_dim: int) -> int:
    """Query rows per request up to which a forward of this head dim attends through our kernel:
    DDTREE_ATTENTION_KERNEL (0: never; 1: `ar` steps only; at most 128: trees up to budget 127 too, and so every
    forward of that many rows a request: batched verifies, prefills of up to 128 tokens). Unset: 128 where heads are
    256 wide (Qwen3.5/3.6) or 16 to 64 wide (SmolLM2, the embedded default; tl.dot wants 16), `ar` steps only
    otherwise. On the H200 the kernel made a 27B verify's attention 3.5x faster at 17 rows
    (perf/results/attention_h200_ours.md: PyTorch's cuDNN SDPA is slow at d=256), and timed in turns
    (perf/graph_turns.py, graph_turns_h200_qkv_treeattn.md) the captured 27B verify took 0.979x the time of the SDPA
    form at budget 16 and 0.986x at 64; at Qwen3-8B dims (d=128, where SDPA's flash kernel is quick) the verify
    replayed 6.35 / 7.38 ms with trees through ours against 5.76 / 6.08 through SDPA (gpu_ratios_h200_27b_8b.md,
    measured one after the other). At SmolLM2-135M's dims (9 heads of 64, 3 K/V heads; measured in the Qwen3 form,
    with q/k norms) cuDNN's SDPA took 0.50 ms of a `ddtree-16` round's kernels on an H100 (29 calls of 17 us), the
    verify program replaying in 1.39 ms against the `ar` step's 0.64, and whole rounds with trees through ours took
    0.767x (`ddtree-16`) / 0.810x (`ddtree-64`) / 0.758x (`dflash`) the time, `ar`'s 0.997x, in 3 turns beside an
    A/A control at 0.998 / 1.007 / 0.990 / 1.000 (perf/results/gpu_ratios_h100_smollm2_treeattn.md). Prefills and
    batched verifies at those dims take it too, not measured."""
    value = os.environ.get("DDTREE_ATTENTION_KERNEL")
    if value is None:
        return ATTENTION_KERNEL_MAX_ROWS if head_dim >= 256 or 16 <= head_dim <= 64 else 1
    return min(int(value), ATTENTION_KERNEL_MAX_ROWS) if value.strip() else 0


def qkv_kernel(device: torch.device) -> Callable | None:
    """Our kernel for an attention layer's q/k norms, rotary and K/V pool writes in one launch
    (ddtree.models.attention_kernel.prepare_qkv) for packed forwards on CUDA, or None (the compiled chains and
    index writes: eight kernels per layer at Qwen3.6-27B; DDTREE_QKV_KERNEL=0). On the H200, timed in turns beside
    the chains (graph_turns_h200_qkv_treeattn.md), the captured 27B `ar` step took 0.982x their time and the verify
    0.991x / 0.983x at budgets 16 / 64. It reads each row's slot and position by their strides: a static forward's
    lone request has its slot broadcast over its rows (a stride-0 view), which, read as contiguous, once wrote K/V at
    stray slots and faulted (perf/results/qkv_fault_h200.log). Heads without q/k norms (a Llama's: SmolLM2, the
    embedded default) take it only where qkv_kernel_without_norms says so."""
    if device.type != "cuda" or _qkv_setting() in ("", "0"):
        return None
    return _qkv_kernel()


def _qkv_setting() -> str:
    return os.environ.get("DDTREE_QKV_KERNEL", "1").strip()


def qkv_kernel_without_norms() -> bool:
    """Whether heads without q/k norms (Llama: SmolLM2, the embedded default) take qkv_kernel too, their rotary and
    K/V writes in one launch instead of a compiled rotary chain per tensor and two index writes a layer:
    DDTREE_QKV_KERNEL=all. Off by default: its GPU test at SmolLM2's dims passed at 357d96c (the compiled kernel
    against the eager rotary chain and index writes, bf16, tests/gpu/test_attention_kernel.py; the products' rounding
    matched to the chain's since, not yet run on a GPU), its speed not yet measured (gpu_ratios' static-llamaqkv)."""
    return _qkv_setting() == "all"


@functools.cache
def _qkv_kernel() -> Callable:
    from ddtree.models.attention_kernel import prepare_qkv
    return prepare_qkv


def draft_qkv_kernel(device: torch.device) -> Callable | None:
    """qkv_kernel for the drafter's blocks where their attention runs in place (DFlashDrafter.forward_pooled with
    draft_attention_kernel): each layer's q/k norms, rotary and the block's K/V writes into the pool in one launch
    instead of two compiled chains and two index writes (15 kernels less a draft of Qwen3.6-27B's 5-layer drafter).
    DDTREE_DRAFT_QKV_KERNEL=1; off by default: whole 27B rounds on an H100 0.985 / 1.016 / 1.015x (`dflash` /
    `ddtree-16` / `ddtree-64`) those without it (perf/results/gpu_ratios_h100_draftqkv.md, 3 turns, e35526a)."""
    if os.environ.get("DDTREE_DRAFT_QKV_KERNEL", "0") in ("", "0"):
        return None
    return qkv_kernel(device)


def draft_attention_kernel(device: torch.device) -> Callable | None:
    """Our split-KV masked attention for the drafter's pooled blocks (DFlashDrafter.forward_pooled: the static pass)
    on CUDA, or None (contexts gathered, SDPA): DDTREE_DRAFT_ATTENTION_KERNEL=0 turns it off. A 16-row block against
    its context is the shape our kernel won by 3.5x at the target (perf/results/attention_h200_ours.md)."""
    if device.type != "cuda" or os.environ.get("DDTREE_DRAFT_ATTENTION_KERNEL", "1") in ("", "0"):
        return None
    return _attention_kernel()


@functools.cache
def _attention_kernel() -> Callable:
    from ddtree.models.attention_kernel import masked_attention
    return masked_attention


def steps_gdn_kernel(device: torch.device) -> Callable | None:
    """Our kernel's `ar` steps (ddtree.models.tree_kernel.steps_in_place: one token per sequence, each state read and
    written in place in the recurrent pool) where tree_gdn_kernel runs, else None (fla's kernel on gathered states)."""
    return None if tree_gdn_kernel(device) is None else _steps_kernel()


def conv_steps_kernel(device: torch.device) -> Callable | None:
    """Our kernel for an `ar` step's conv (ddtree.models.tree_kernel.conv_steps_in_place: each window read and
    shifted in place in the recurrent pool, one kernel for what was the compiled conv's two and a copy) where our
    steps kernel runs (steps_gdn_kernel), else None."""
    return None if steps_gdn_kernel(device) is None else _conv_steps_kernel()


def conv_windows_kernel(device: torch.device) -> Callable | None:
    """Our kernel for a tree batch's GDN conv (ddtree.models.tree_kernel.conv_windows_in_place: each row's window
    gathered from the pool's committed inputs and the rows, the output and the input written into the commit stash)
    where our steps kernel runs, else None (the compiled fused.conv_windows_pooled_into; DDTREE_TREE_CONV_KERNEL=0
    keeps it). On the H200 it made the 27B verify 0.37 ms shorter at budget 16 and 0.80 at 64
    (perf/results/gpu_ratios_h200_optin.md)."""
    if steps_gdn_kernel(device) is None or os.environ.get("DDTREE_TREE_CONV_KERNEL", "1") in ("", "0"):
        return None
    return _conv_windows_kernel()


def tree_gates() -> bool:
    """Whether a tree batch's GDN gates (fused.gdn_gates_into: beta and g from the raw projections, into the commit
    stash) are computed by the conv's kernel (conv_windows_kernel, tree_kernel.conv_windows_in_place's gates) instead
    of a compiled kernel of their own, 48 kernels less a 27B verify; on by default, DDTREE_TREE_GATES=0 turns it off.
    Alone, whole 27B rounds 0.993-0.995x on an H100 (perf/results/gpu_ratios_h100_fused_parts.md); with rows_glu, its
    docstring."""
    return os.environ.get("DDTREE_TREE_GATES", "1") not in ("", "0")


def prologue_views() -> bool:
    """Whether a prologue's chain computed eagerly before the few-rows kernel (a verify's or a drafter's block: the GDN
    output's gated norm, the attention output's sigmoid gate; layers.GatedNormed, layers.SigmoidGated) reads its
    strided gate where it lies, the chain taken over [rows, heads, group] views, instead of after a copy of the gate
    into [rows x heads, group] or [rows, heads x group]: 64 copy kernels less a 27B verify (48 GDN, 16 attention
    layers). Those are likely the `elementwise_kernel<128, 4, gpu_kernel_impl_nocast ...>` of a `ddtree-16` round's
    kernel table on an H100 (perf/results/gpu_ratios_h100_pdl2.md: 58.7 a round, 64 x the 0.92 of its rounds that
    verify a tree; 0.146 ms). On by default (DDTREE_PROLOGUE_VIEWS=0 turns it off): on an H100 at 27B dims in 3 turns
    it made the verify's GPU time 0.22 ms shorter (19.53 against 19.75 ms at budget 16) and whole rounds 0.989 /
    0.992 / 0.983x (`dflash` / `ddtree-16` / `ddtree-64`; perf/results/gpu_ratios_h100_viewsreplay.md)."""
    return os.environ.get("DDTREE_PROLOGUE_VIEWS", "1") not in ("", "0")


def replay_kernel(device: torch.device) -> Callable | None:
    """Our kernel for a paths-form commit's recurrence (ddtree.models.tree_kernel.replay_in_place: each accepted path
    walked from its committed state, read and written in place, the stash's rows read where they lie) where our steps
    kernel runs, else None (DDTREE_REPLAY_KERNEL=0 too): fla's fused recurrent kernel over the path's rows gathered
    into heads, into new states then copied over the committed ones (gdn.replay_apply; at Qwen3.6-27B dims 150 MB
    written and 300 MB copied a commit: the two device-to-device copies of an H100 `ddtree-16` round's commit, 0.105 of
    its 0.29 ms, perf/results/gpu_ratios_h100_pdl2.json). On an H100 at 27B dims in 3 turns it made the commit's GPU
    time 0.30 against 0.46-0.50 ms and whole rounds 0.994 / 0.991 / 0.992x (`dflash` / `ddtree-16` / `ddtree-64`;
    perf/results/gpu_ratios_h100_viewsreplay.md)."""
    if steps_gdn_kernel(device) is None or os.environ.get("DDTREE_REPLAY_KERNEL", "1") in ("", "0"):
        return None
    return _replay_kernel()


@functools.cache
def _replay_kernel() -> Callable:
    from ddtree.models.tree_kernel import replay_in_place
    return replay_in_place


@functools.cache
def _conv_windows_kernel() -> Callable:
    from ddtree.models.tree_kernel import conv_windows_in_place
    return conv_windows_in_place


@functools.cache
def _conv_steps_kernel() -> Callable:
    from ddtree.models.tree_kernel import conv_steps_in_place
    return conv_steps_in_place


@functools.cache
def _tree_kernel() -> Callable:
    from ddtree.models.tree_kernel import batched_tree_paths
    return batched_tree_paths


@functools.cache
def _steps_kernel() -> Callable:
    from ddtree.models.tree_kernel import steps_in_place
    return steps_in_place


def step_gdn_kernel(device: torch.device) -> Callable | None:
    """fla's fused recurrent gated delta rule (one kernel per layer for a decode step) on `device`, or None."""
    if device.type != "cuda":
        return None
    return _fla_fused_recurrent()


def chain_gdn_kernel(device: torch.device) -> Callable | None:
    """fla's chunked gated delta rule for tensors on `device`, or None (CPU, fla missing or disabled)."""
    if device.type != "cuda":
        return None
    return _fla_chunk_gdn()


def gdn_chain_fla(kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain through fla (either kernel: chain_gdn_kernel's chunked one, step_gdn_kernel's fused recurrent one):
    o [N, HV, dv] in v's dtype and the final state [HV, dk, dv] in float32.

    Same conventions as gdn.gdn_sequential with parents = [-1, 0, 1, ...]: q, k [N, H, dk] raw (l2-normalised
    in the kernel, q scaled by dk**-0.5; H divides HV: value head j reads key head j // (HV / H)), g [N, HV] log
    decay, beta [N, HV], initial_state [HV, dk, dv].
    """
    o, state = gdn_sequences_fla(kernel, q[None], k[None], v[None], g[None], beta[None], initial_state[None])
    return o[0], state[0]


def gdn_sequences_fla(kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, initial_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B sequences of T tokens through fla in one call (gdn_chain_fla's conventions with a leading batch dim):
    q, k [B, T, H, dk], v [B, T, HV, dv], g, beta [B, T, HV], initial_states [B, HV, dk, dv] -> o [B, T, HV, dv] in
    v's dtype and the final states [B, HV, dk, dv] in float32."""
    dtype = v.dtype
    return kernel(q.to(dtype), k.to(dtype), v, g=g.float(), beta=beta.to(dtype),
                  initial_state=initial_states.float().contiguous(), output_final_state=True,
                  use_qk_l2norm_in_kernel=True)


__all__ = [
    "attention_kernel", "attention_kernel_rows", "chain_gdn_kernel", "conv_steps_kernel", "conv_windows_kernel",
    "draft_attention_kernel", "draft_qkv_kernel", "draft_top_kernel", "gdn_chain_fla", "gdn_sequences_fla", "gemv_kernel", "gemv_max_rows",
    "norm_parts", "pdl", "qkv_kernel", "qkv_kernel_without_norms", "replay_kernel", "step_gdn_kernel",
    "steps_gdn_kernel", "tree_chunk_kernel", "tree_gdn_kernel",
]
