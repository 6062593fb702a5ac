"""Static forwards: bucketed shapes, inputs in static buffers, CUDA graphs on CUDA.

A 27B hybrid step is a few thousand small kernels; launched one by one from Python, the host, not the
memory bus, sets the pace (and for a small model the host is all there is: a dynamic batched round of the
135M default costs ~25 ms on an H200 whatever the batch). A static forward has fixed shapes (rows padded
to a bucket, keys to a power of two, requests to a power of two), reads every per-round value from static
device buffers, and derives the rest there (each tree's ancestor matrix, conv windows, attention mask and
cache write positions, from the parents and the start positions), with no host reads. So on CUDA it is
captured once per shape and replayed: one copy of a few integers to the device and one graph launch per
pass. Off CUDA the same code runs eagerly, which is how the CPU tests check it against the dynamic forward
and against target-only decoding.

Padding is harmless by construction: a padding row's parent is -1 (it sees the committed prefix and
itself), its cache writes land beyond the tree where nothing reads before the next overwrite, and its
outputs are cut off before anyone sees them; a padding request works in a scratch cache slot that no
request holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.models import fused, kernels, qwen3_5
from ddtree.models.dense import ForwardPlan, PackedAttention, Segment
from ddtree.models.gdn import (
    ReplayStash,
    TreeLayout,
    TreePaths,
    ancestors_from_parents,
    conv_window_index,
    leaves,
    replay_apply,
    replay_columns,
    replay_windows,
    tree_paths,
)
from ddtree.models.qwen3_5 import PATHS_MAX_LEN, PooledSlot
from ddtree.tree.device import build_tree_device, candidate_grid, fits_budget, tree_paths_device, verify_rows

logger = logging.getLogger(__name__)

MIN_KEYS = 256   # the smallest key bucket


def row_bucket(n: int) -> int:
    """Rows a forward of n rows is padded to: 1, 2, 3, 4, 5, 8, 9, 16, 17, ... (a budget b verifies b + 1 rows)."""
    if n <= 2:
        return max(n, 1)
    power = 1 << (n - 1).bit_length()          # the next power of two >= n
    return power // 2 + 1 if n <= power // 2 + 1 else power


def key_bucket(n: int, limit: int) -> int | None:
    """Keys an attention over n cache positions is padded to (a power of two >= MIN_KEYS, at most limit)."""
    keys = max(MIN_KEYS, 1 << (n - 1).bit_length())
    keys = min(keys, limit)
    return keys if keys >= n else None


@dataclass(slots=True)
class Program:
    """One static forward: its buffers, the body that computes from them, and (on CUDA) its captured graph."""
    body: Callable[[], Any]
    host: torch.Tensor                 # int64 inputs on the host (pinned on CUDA), copied to `inputs` per call
    inputs: torch.Tensor               # the same on the device
    graph: Any = None                  # torch.cuda.CUDAGraph once captured; False: capture failed, runs eagerly
    outputs: Any = None
    extra: dict = field(default_factory=dict)


class GraphPool:
    """Programs by shape key; captured lazily on first use into one shared memory pool (their outputs are only
    valid until the next replay of any of them: callers consume them first)."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.programs: dict[tuple, Program] = {}
        self.warmed = False                  # set after the engine's warm-up: programs made later are logged
        self.late_keys: list[tuple] = []     # the keys made after warm-up (each compiled, captured on a request)

    def program(self, key: tuple, make: Callable[[], Program]) -> Program:
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = make()
            if self.warmed:
                self.late_keys.append(key)
                logger.warning("static program %s made while serving (not prepared by warm-up; %d so far)",
                               key, len(self.late_keys))
        return program

    def new_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        return host, torch.zeros(size, dtype=torch.long, device=self.device)

    def run(self, key: tuple, program: Program, writes: tuple = (), staged: bool = False) -> Any:
        """Copy the program's host inputs to the device and run it (replay its graph, capturing it the first time).
        writes: (offset, device tensor) pairs copied over the inputs after the host's (inputs computed on the device).
        staged: the host inputs copied from a pinned copy of their own (the caching host allocator keeps it until the
        copy has run), for a caller that refills the program's host inputs before the device has read the last ones
        (Engine's `ar` lookahead: two steps queued at once)."""
        host = program.host
        if staged and self.device.type == "cuda":
            host = torch.empty_like(program.host, pin_memory=True).copy_(program.host)
        program.inputs.copy_(host, non_blocking=True)
        for offset, values in writes:
            program.inputs[offset : offset + values.numel()].copy_(values.flatten())
        with fused.static():   # the elementwise chains compiled (CUDA): paid once per capture, not per call
            if not self.capture or program.graph is False:
                return program.body()
            # graphs capture on and replay into the calling thread's current device: make it the engine's (a replica
            # on cuda:1 runs its engine in a thread whose current device would otherwise be cuda:0)
            with torch.cuda.device(self.device):
                return self._run_graph(key, program)

    def _run_graph(self, key: tuple, program: Program) -> Any:
        if program.graph is None:
            # the first call runs eagerly (its results are this call's) and then captures: a capture records
            # without executing, so the body's in-place writes (cache rows, a committed recurrent state) happen once
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                outputs = program.body()   # also the warm-up: lazy initialisations, library handles, autotuning
            torch.cuda.current_stream(self.device).wait_stream(stream)
            try:
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls from other threads of the server (Triton's) do not break this capture
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    program.outputs = program.body()
                program.graph = graph
                logger.info("captured a CUDA graph for %s (%d graphs)", key, len(self.programs))
            except Exception as exc:   # an op that cannot be captured: this shape runs eagerly from now on
                logger.warning("CUDA graph capture failed for %s (%s: %s); it runs eagerly", key, type(exc).__name__, exc)
                program.graph, program.outputs = False, None
                torch.cuda.synchronize(self.device)
            return outputs
        program.graph.replay()
        return program.outputs


def prefill_bucket(n: int) -> int:
    """Rows each prompt of a group prefilled together is padded to: the next power of two, at least 16 (fewer programs
    than row_bucket's, made at warm-up for every group size: StaticTarget.batch's prefill)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def batch_bucket(n: int) -> int:
    """Requests a batched static forward is padded to: the next power of two (padding requests use a scratch slot)."""
    return 1 << max(n - 1, 0).bit_length()


class StaticTarget:
    """The target's verify (or ar step) of any number of requests as one static forward (each padded to the same
    rows, the request count to a bucket); a hybrid target's requests each run their GDN layers on their own slot's
    recurrent state, named by the program's inputs."""

    MAX_ROWS = 4096   # requests x rows of one batched static forward (beyond: the dynamic forward)

    def __init__(self, target, tap_layers: list[int], graphs: GraphPool, scratch: int | None = None) -> None:
        """scratch: a cache slot no request holds, where padding requests write (None: no request padding)."""
        self.target, self.tap_layers, self.graphs, self.scratch = target, list(tap_layers), graphs, scratch
        self.conv_kernel = getattr(target.config, "conv_kernel", None)   # hybrid targets only
        self.uses_paths = getattr(target, "uses_paths", lambda rows, device: False)
        self._made, self._made_count = {}, -1   # _made_rows' index of the programs, and their count when it was made
        self._tree_keys: set[int] = set()       # key buckets with a verify of several requests' trees made

    def __call__(self, cache, start: int, input_ids, positions, parents: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One request: logits [n, vocab] and taps [n, ...] of its n tree rows (views of static outputs: read them
        before the next static forward), or None where no static shape fits (the caller runs the dynamic forward).
        input_ids, positions  # n host integers (lists, numpy or CPU tensors); parents  # n, -1 for the root"""
        return self.batch([cache], [start], [input_ids], [positions], [parents])

    def batch(self, caches: list, starts: list[int], input_ids: list, positions: list, parents: list[list[int]],
              tree: tuple[torch.Tensor, torch.Tensor | None] | None = None, staged: bool = False,
              prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Several requests' trees (the lists hold one entry per request): logits and taps of their rows packed in
        request order, or None (the caller runs the dynamic forward).
        tree: a lone request's tree inputs on the device (StaticTreeBuild's: its rows' ids, positions and parents, and
        its paths where device_tree_shape says it takes them), which the program reads instead of the host's
        input_ids, positions and parents (placeholders of the tree's length); (ids, None) for the ids alone: a lone
        request's tree's, or one id per request where every request has one row (the `ar` lookahead's steps).
        staged: see GraphPool.run.
        prefill: prompts from position 0 (chains), a program that serves every slot (a lone request's too: prefills,
        which a request runs once, in whatever slot it was given, instead of one made for its slot) whose logits are
        each request's last row's alone, [requests, vocab] (a prefill reads nothing else: every row's took rows x vocab
        in each program's outputs, 771 rows more over the 16 lone prefill buckets to 256 rows: 358 MiB in bf16 at
        Qwen3.6-27B's vocabulary of 248,320, and the lm_head's pass over them); several prompts are padded to
        prefill_bucket rows each (a lone one to row_bucket's)."""
        shape = self._shape(caches, starts, parents, prefill)
        if shape is None:
            return None
        reqs, rows, keys = shape
        assert tree is None or reqs == 1 or rows == 1, "device inputs of several requests: one row each"
        if self.conv_kernel is not None:
            return self._hybrid(*shape, caches, starts, input_ids, positions, parents, tree, staged, prefill)
        # a batch's program serves every slot (the slots are inputs); a lone request's is made for its slot, whose K/V
        # its attention reads as views of the pool (no gather of every key per layer: 2 index kernels per layer, ~1 MB
        # each at Qwen3-8B dims and 512 keys), as a hybrid target's (a lone request mostly holds slot 0)
        fixed_slot = caches[0].slot if reqs == 1 and not prefill else None
        key = ("batch", reqs, rows, keys) + (("prefill",) if prefill else (fixed_slot,) if fixed_slot is not None else ())
        program = self.graphs.program(key, lambda: self._make_batch(caches[0], reqs, rows, keys, fixed_slot, prefill))
        total, rest = self._fill(program.host.numpy(), reqs, rows, caches, starts, input_ids, positions, parents)
        if prefill:
            _last_rows(rest, rows, parents)
        logits, taps = self.graphs.run(key, program, () if tree is None else ((0, tree[0]),), staged)
        return logits[: len(caches) if prefill else total], None if taps is None else taps[:total]

    def device_tree_shape(self, cache, start: int, num_rows: int) -> tuple[int, int] | None:
        """(rows, paths) of a lone request's static verify of a tree of num_rows rows whose inputs are built on the
        device (batch's `tree`): paths = 0 where the program takes no paths form; None where no static program fits,
        or where its paths form would depend on the tree (fla's kernel: a program per leaf count)."""
        shape = self._shape([cache], [start], [[-1] * num_rows])
        if shape is None or shape[0] != 1:
            return None
        rows = shape[1]
        if self.conv_kernel is None or not self.uses_paths(rows, self.graphs.device):
            return rows, 0
        return (rows, rows) if self.target.free_padding_paths(self.graphs.device) else None

    def _shape(self, caches: list, starts: list[int], parents: list[list[int]], prefill: bool = False
               ) -> tuple[int, int, int] | None:
        """(requests, rows, keys) of a batched static forward: rows padded to the largest tree's bucket (a group
        prefill's: prefill_bucket), requests to a power of two (padding requests in the scratch slot), keys to a bucket;
        None where none fits."""
        longest = max(len(p) for p in parents)
        rows = prefill_bucket(longest) if prefill and len(caches) > 1 else row_bucket(longest)
        keys = key_bucket(max(starts) + rows, caches[0].max_len)
        reqs = batch_bucket(len(caches)) if self.scratch is not None else len(caches)
        # from position 0: a prefill (a hybrid's slot state is reset first: _hybrid)
        if min(starts) < 0 or keys is None or reqs * rows > self.MAX_ROWS:
            return None
        if reqs > 1 and rows > 1 and not prefill and self.graphs.warmed:
            # after warm-up, trees of several requests whose row bucket has no program here (the smaller trees of
            # requests that end together: their last rounds' depth is cut) are padded to the smallest made bucket
            # above it (Engine._warm_batched_verifies) instead of making one on requests' time; one-token steps keep
            # their own (warm-up makes them, and the `ar` lookahead's device ids are one a request)
            made = self._made_rows(reqs, keys)
            above = [r for r in made if r > rows and max(starts) + r <= keys]
            if above and rows not in made:
                rows = above[0]
        return reqs, rows, keys

    def made_tree_rows(self, num_reqs: int, max_start: int, max_len: int) -> int | None:
        """After warm-up, the most rows each of num_reqs requests' trees (several requests, the furthest root at
        max_start) may have to verify through a program already made: 0 where none is, None where any may (before
        warm-up, a lone request, no padding slot, keys where warm-up made no verify of several requests: those are
        made on first use, as before warm-up's limits). Every tree of at most r rows then takes the key bucket of
        max_start + 1 (its rows end within it), where a program of r rows is made (_shape pads a smaller bucket up)."""
        if num_reqs < 2 or self.scratch is None or not self.graphs.warmed:
            return None
        keys = key_bucket(max_start + 1, max_len)
        made = self._made_rows(batch_bucket(num_reqs), keys) if keys is not None else []   # (the index up to date)
        if keys not in self._tree_keys:
            return None   # no tree's verify made at these keys for any batch (past WARM_UP_MAX_KEYS, or memory 0): on use
        return max((r for r in made if max_start + r <= keys), default=0)

    def _made_rows(self, reqs: int, keys: int) -> list[int]:
        """Row buckets (ascending) of the several requests' verifies made for this request bucket and key bucket."""
        if self._made_count != len(self.graphs.programs):
            kind, self._made = "target" if self.conv_kernel is not None else "batch", {}
            for key in self.graphs.programs:
                if key[0] == kind and key[1] > 1 and key[-1] != "prefill":
                    self._made.setdefault((key[1], key[3]), set()).add(key[2])
            self._made = {k: sorted(v) for k, v in self._made.items()}
            self._tree_keys = {keys for (_, keys), rows in self._made.items() if rows[-1] > 1}   # made_tree_rows
            self._made_count = len(self.graphs.programs)
        return self._made.get((reqs, keys), [])

    def _fill(self, host: np.ndarray, reqs: int, rows: int, caches: list, starts: list[int], input_ids: list,
              positions: list, parents: list[list[int]]) -> tuple[int, np.ndarray]:
        """Write the requests into a batched program's host inputs (ids, positions, parents, starts, slots, output
        rows, then whatever the program adds); padding rows are roots of their own, padding requests sit in the
        scratch slot, their outputs unread. Returns (the requests' rows, the host inputs after these)."""
        n = reqs * rows
        ids, pos, par, start, slot, out, rest = np.split(host, np.cumsum([n, n, n, reqs, reqs, n]))
        ids[:], pos[:], par[:], out[:] = 0, 0, -1, 0
        start[:], slot[:] = 0, self.scratch if self.scratch is not None else 0
        row = 0
        for r, (cache, s, tree) in enumerate(zip(caches, starts, parents)):
            size = len(tree)
            at = slice(r * rows, r * rows + size)
            ids[at], pos[at], par[at] = input_ids[r], positions[r], tree
            pos[r * rows + size : (r + 1) * rows] = s
            start[r], slot[r] = s, cache.slot
            out[row : row + size] = np.arange(r * rows, r * rows + size)
            row += size
        return row, rest

    def _make_batch(self, cache, reqs: int, rows: int, keys: int, fixed_slot: int | None = None,
                    last_row: bool = False) -> Program:
        """last_row: the logits of each request's last row alone (batch's prefill; the rows named by the inputs after
        the output rows)."""
        n = reqs * rows
        host, inputs = self.graphs.new_inputs(4 * n + 2 * reqs + reqs * last_row)

        def body():
            ids, positions, parents, starts, slots, out, last = inputs.split([n, n, n, reqs, reqs, n, reqs * last_row])
            ancestors = ancestors_from_parents(parents.view(reqs, rows))          # [R, Q, Q]
            plan = ForwardPlan(PackedAttention.static(slots, starts, ancestors, keys, fixed_slot=fixed_slot))
            segment = Segment(cache=cache, start=-1, length=n, mask=ancestors)   # the pool is all a dense forward reads
            logits, taps = self.target.forward_packed(ids, positions, [segment], self.tap_layers or None,
                                                      logit_rows=last if last_row else out, plan=plan)
            return logits, None if taps is None else taps[out]

        return Program(body=body, host=host, inputs=inputs)

    def _hybrid(self, reqs: int, rows: int, keys: int, caches: list, starts: list[int], input_ids: list, positions: list,
                parents: list[list[int]], tree: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                staged: bool = False, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A hybrid target's verify (or ar step) of several requests as one static forward, shaped like the dense one;
        every request's GDN layers run on its own slot's state (PooledSlot), its tree on its own layout. Each
        request's commit stash goes to its cache (compact() commits from it). prefill: see batch."""
        paths, num_paths = [], 0
        # a prefill's chain is one path as long as the prompt, past the paths form's PATHS_MAX_LEN: the masked form
        if self.uses_paths(rows, self.graphs.device) and min(starts) > 0:
            # the paths form: each tree's root-to-leaf paths (padding rows take none), padded to a count (a program per
            # count; padding requests have none): with our kernel as many as rows (padding paths cost nothing), so one
            # program per row bucket serves every tree and warm-up prepares them all; with fla's kernel, which copies
            # a state per path, the leaves' bucket
            free = self.target.free_padding_paths(self.graphs.device)
            if tree is not None and (not free or tree[1] is None):
                return None   # device_tree_shape declines these; ids alone (the `ar` lookahead) take no paths form
            num_paths = rows if free else row_bucket(max(len(leaves(p)) for p in parents))
            if tree is None:
                paths = [tree_paths(p, PATHS_MAX_LEN, num_paths, num_paths * PATHS_MAX_LEN, num_nodes=rows) for p in parents]
                if any(p is None for p in paths):
                    return None
        for cache, start in zip(caches, starts):
            if start == 0:        # a prefill: the program reads the slot's recurrent state, which starts from zero
                cache.reset()
        # a lone request's program works on its own cache's views (no per-layer gather and scatter of its recurrent
        # state: ~0.1 ms and 300 MB of a 27B step; its attention reads its K/V as views too), so it is made per slot
        # (a lone request mostly holds slot 0); a batch's program, and a prefill's, serves every slot (slots are inputs)
        pooled = reqs > 1 or prefill
        key = ("target", reqs, rows, keys, num_paths) + (("prefill",) if prefill else () if pooled else (caches[0].slot,))
        program = self.graphs.program(key, lambda: self._make_hybrid(caches[0], reqs, rows, keys, num_paths, pooled,
                                                                     prefill))
        total, rest = self._fill(program.host.numpy(), reqs, rows, caches, starts, input_ids, positions, parents)
        rest[:] = 0                                    # padding requests: no paths
        if prefill:
            _last_rows(rest[rest.size - reqs :], rows, parents)
        if num_paths and tree is None:
            tokens, bounds, node_pos = np.split(rest, np.cumsum([reqs * num_paths * PATHS_MAX_LEN, reqs * (num_paths + 1)]))
            for r, (t, b, p) in enumerate(paths):
                tokens[r * t.size : (r + 1) * t.size], bounds[r * b.size : (r + 1) * b.size] = t, b
                node_pos[r * rows : (r + 1) * rows] = p
        writes = ()
        if tree is not None:   # a lone request's: ids, positions, parents first; its paths after starts, slots, rows
            writes = ((0, tree[0]),) + (((4 * rows + 2, tree[1]),) if num_paths else ())
        logits, taps, stashes = self.graphs.run(key, program, writes, staged)
        # a replay's stashes are the captured program's outputs, the same memory every replay (StaticCommit bakes it
        # in); a first call's are its eager run's, a one-off
        fixed = not self.graphs.capture or (program.graph not in (None, False) and stashes is program.outputs[2])
        for cache, stash in zip(caches, stashes):
            cache.pending = stash          # what compact() commits from (set by the body, which a replay skips)
            cache.static_stash = stash if fixed else None
        return logits[: len(caches) if prefill else total], None if taps is None else taps[:total]

    def _make_hybrid(self, cache, reqs: int, rows: int, keys: int, num_paths: int, pooled: bool,
                     last_row: bool = False) -> Program:
        """num_paths: 0, or the (bucketed) number of root-to-leaf paths of each request's tree (the paths form). A
        pooled program (a batch's, or a prefill's) works on any slot named by its inputs (PooledSlot over `cache`'s
        pools); another on `cache` itself. last_row: as _make_batch's."""
        n = reqs * rows
        path_sizes = [num_paths * PATHS_MAX_LEN, num_paths + 1, rows] if num_paths else []   # per request
        host, inputs = self.graphs.new_inputs(4 * n + 2 * reqs + reqs * sum(path_sizes) + reqs * last_row)

        def body():
            ids, positions, parents, starts, slots, out, rest, last = inputs.split(
                [n, n, n, reqs, reqs, n, reqs * sum(path_sizes), reqs * last_row])
            parents = parents.view(reqs, rows)
            ancestors = ancestors_from_parents(parents)                               # [R, Q, Q]
            per_request = ([part.view(reqs, -1) for part in rest.split([reqs * size for size in path_sizes])]
                           if num_paths else None)
            layouts, segments = [], []
            for r in range(reqs):
                tree = TreePaths(*(part[r] for part in per_request)) if num_paths else None
                layouts.append(TreeLayout(ancestors=ancestors[r], window=conv_window_index(parents[r], self.conv_kernel),
                                          paths=tree))
                handle = PooledSlot(cache, slots[r : r + 1]) if pooled else cache
                segments.append(Segment(cache=handle, start=-1, length=rows, mask=ancestors[r]))   # start, mask: the plan's
            plan = ForwardPlan(PackedAttention.static(slots, starts, ancestors, keys,
                                                      fixed_slot=None if pooled else cache.kv.slot), layouts)
            logits, taps = self.target.forward_packed(ids, positions, segments, self.tap_layers or None,
                                                      logit_rows=last if last_row else out, plan=plan)
            stashes = [seg.cache.pending for seg in segments]
            return logits, None if taps is None else taps[out], stashes

        return Program(body=body, host=host, inputs=inputs)


def _last_rows(last: np.ndarray, rows: int, parents: list[list[int]]) -> None:
    """A prefill program's host inputs naming each request's last row (r x rows + its length - 1; a padding request's
    first, unread)."""
    last[:] = np.arange(last.size) * rows
    for r, tree in enumerate(parents):
        last[r] += len(tree) - 1


def path_bucket(n: int) -> int:
    """Rows an accepted path of n rows is padded to in a static commit: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


class StaticCommit:
    """A lone hybrid request's commit after a paths-form static verify as a static program: the K/V moves of its accepted
    rows and the replay of every GDN layer's state and conv window along its accepted path (gdn.replay_apply), with
    the path padded to a bucket (padding rows: zero decay and zero beta, which leave the state exactly as it was;
    padding K/V moves copy the root's row onto itself). Launched one by one that is ~20 kernels and fla's Python
    wrapper: 0.64 ms of host time per round at Qwen3.6-27B dims on an H200, where the device needs a fraction.

    A program is made per (slot, bucket, stash): the stash is a static verify's output, the same memory every
    replay of that verify; on CUDA its addresses are part of the key (a program bakes them in)."""

    def __init__(self, graphs: GraphPool) -> None:
        self.graphs = graphs

    def __call__(self, cache, start: int, accepted: list[int]) -> bool:
        """Commit `accepted` (the accepted root path's rows of the last forward, root first) of `cache`, a
        HybridCache whose pending stash is a ReplayStash; False (nothing done) for any other pending state."""
        stash = cache.pending
        if not isinstance(stash, ReplayStash) or not accepted:
            return False
        if self.graphs.capture and stash is not getattr(cache, "static_stash", None):
            return False   # not a captured verify's stash (a dynamic forward's, a first call's): no fixed memory
        base = stash.base or stash
        n, width = len(accepted), path_bucket(len(accepted))
        tensors = (base.qkv, base.g, base.beta, base.x)
        where = tuple((t.data_ptr(), tuple(t.shape)) for t in tensors) if self.graphs.capture else ()
        key = ("commit", cache.slot, width) + where
        program = self.graphs.program(key, lambda: self._make(cache, width))
        program.extra["stash"] = base      # read by the body: once, at capture, on CUDA (the key names its memory)
        kernel_size = cache.conv.shape[-1]
        rows, valid, dst, src, columns = np.split(program.host.numpy(), np.cumsum([width] * 4))
        rows[:], valid[:] = stash.offset + accepted[0], 0
        rows[:n], valid[:n] = [stash.offset + a for a in accepted], 1
        dst[:], src[:] = start, start + accepted[0]      # padding: the root's row onto itself (as the first move)
        dst[:n], src[:n] = np.arange(start, start + n), [start + a for a in accepted]
        columns[:] = replay_columns([n], kernel_size, width)
        self.graphs.run(key, program)
        cache.pending = None
        return True

    def _make(self, cache, width: int) -> Program:
        kernel_size = cache.conv.shape[-1]
        host, inputs = self.graphs.new_inputs(4 * width + kernel_size)
        cu = torch.tensor([0, width], dtype=torch.long, device=inputs.device)
        slot = torch.zeros(1, dtype=torch.long, device=inputs.device)
        in_place, extra = qwen3_5.replay_kernel(inputs.device), {}
        kernel = qwen3_5.step_gdn_kernel(inputs.device) if in_place is None else None   # fla's, only where it replays

        def body():
            rows, valid, dst, src, columns = inputs.split([width] * 4 + [kernel_size])
            kv, base = cache.kv, extra["stash"]
            kv.k[:, dst] = kv.k[:, src]
            kv.v[:, dst] = kv.v[:, src]
            if in_place is not None:   # the states written where they lie (kernels.replay_kernel)
                in_place(base, rows, cu, cache.state[None], slot, valid)
                cache.conv.copy_(replay_windows(base, rows, columns, cache.conv[None])[0])
                return
            state, window = replay_apply(base, rows, cu, columns, cache.state[None], cache.conv[None], kernel, valid)
            cache.state.copy_(state[0])
            cache.conv.copy_(window[0])

        return Program(body=body, host=host, inputs=inputs, extra=extra)


class StaticTreeBuild:
    """A lone request's draft tree and its verify's tree inputs, built on the device from the drafter's hidden states
    (tree.device) as a static program: the draft's logits, log-probabilities and top-k, then the tree, queued behind
    the drafter and read by the verify's program (StaticTarget.batch's `tree`), so that a round reads the device once,
    after its verify, and launches one program between them where the draft's head, top-k and the copies into the
    tree's inputs took ~10 launches (the host's time in the draft stage: in Triton's slower stub interpreter, 1.5 ms of
    a 135M model's round against 0.9 in process, perf/results/humaneval_h200_devtree.md). A program per (block depth,
    rows, paths), as the verify's: a tree of any budget up to rows - 1 (its ranks past k or the depth at -inf, its rows
    past the tree padding)."""

    def __init__(self, graphs: GraphPool, token_ids: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """token_ids: the draft vocabulary's positions -> token ids (DraftVocab.token_ids)."""
        self.graphs, self.token_ids = graphs, token_ids

    def __call__(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], k: int, budget: int,
                 depth: int, root: int, start: int, rows: int, num_paths: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the verify's ids, positions and parents  # [3, rows], its paths form or None) of the tree over the top k of
        each of the first `depth` levels; hidden  # [block depth, hidden] the drafter's outputs after its root, head:
        hidden -> draft logits  # [block depth, draft vocabulary] (the engine's, the same function at every call: under
        CUDA graphs the first call's is what replays), k <= budget < rows. The first output (a copy, which later programs
        leave alone) holds the tree: of its first fits_budget(depth, k, budget) + 1 rows, ids[1:] are the nodes' tokens,
        positions[1:] - start their depths, parents[1:] their parents."""
        key = ("tree", hidden.shape[0], rows, num_paths)
        program = self.graphs.program(key, lambda: self._make(hidden, rows, num_paths))
        program.host.numpy()[:] = root, start, fits_budget(depth, k, budget) + 1, k, depth
        program.extra["hidden"].copy_(hidden)
        program.extra["head"] = head
        out, paths = self.graphs.run(key, program)
        return out.clone(), paths

    def _make(self, hidden: torch.Tensor, rows: int, num_paths: int) -> Program:
        host, inputs = self.graphs.new_inputs(5)   # root, start, nodes + 1, k, depth
        levels, width, device = hidden.shape[0], rows - 1, hidden.device
        extra = {"hidden": torch.zeros_like(hidden), "head": None, "grid": candidate_grid(width, width, device)}
        columns, depths = torch.arange(width, device=device), torch.arange(levels, device=device)
        build = kernels.tree_build_kernel(device)   # the body in two Triton launches, or None: tensor forms
        top_k = kernels.draft_top_kernel(device)   # the log-probabilities' top k in two launches, or None: torch's
        if build is not None:
            scratch = kernels.tree_build_scratch(levels, width, extra["grid"][0].shape[0], device)

        def body():
            logits = extra["head"](extra["hidden"])                                        # [levels, vocab]
            top = min(width, logits.shape[-1])
            if top_k is not None:
                log_probs, positions = top_k(logits, top)
            else:
                log_probs, positions = torch.topk(torch.log_softmax(logits, dim=-1, dtype=torch.float32), top)
            token_ids = self.token_ids(positions)
            if top < width:   # a vocabulary smaller than the row bucket (tiny models): padding ranks at -inf
                log_probs = F.pad(log_probs, (0, width - top), value=float("-inf"))
                token_ids = F.pad(token_ids, (0, width - top))
            past = (columns[None, :] >= inputs[3]) | (depths[:, None] >= inputs[4])     # ranks past k, levels past depth
            # and NaN (a level of the draft with a NaN logit): the builders order nodes by score, and a NaN sorted first
            # would put a node under a parent outside the tree; at -inf no node outranks its parent
            log_probs = log_probs.masked_fill(past | log_probs.isnan(), float("-inf"))
            if build is not None:
                return build(log_probs, token_ids, width, extra["grid"], scratch, inputs, num_paths, PATHS_MAX_LEN)
            root, start, num_nodes = inputs[:3]
            tree = build_tree_device(log_probs, token_ids, width, extra["grid"])
            head = verify_rows(root, start, num_nodes, *tree)
            return head, tree_paths_device(head[2], num_nodes, PATHS_MAX_LEN, num_paths) if num_paths else None

        return Program(body=body, host=host, inputs=inputs, extra=extra)


class StaticDrafter:
    """The drafter's pass for a batch of requests (append each one's new context features, then draft their
    blocks) as a static forward; the blocks' embedding (the target's table) runs inside it too."""

    MAX_ROWS = 2048   # requests x context rows of one static pass (a just-prefilled prompt's features can be many)

    def __init__(self, drafter, embed: Callable[[torch.Tensor], torch.Tensor], graphs: GraphPool,
                 scratch: int | None = None) -> None:
        """scratch: a cache slot no request holds, where padding requests write (None: no request padding)."""
        self.drafter, self.embed, self.graphs, self.scratch = drafter, embed, graphs, scratch
        self.block = drafter.block_size
        self.round_rows = row_bucket(self.block + 1)   # the most context rows a drafting round appends (its path)
        self.catch_up_rows = 0   # context rows written by the dynamic pass ahead of a static one (batch)

    def __call__(self, cache, taps: torch.Tensor | None, block_ids: list[int]) -> torch.Tensor | None:
        """One request: see batch."""
        return self.batch([cache], [taps], [block_ids])

    def batch(self, caches: list, taps: list[torch.Tensor | None], blocks: list[list[int]],
              rows: int | None = None) -> torch.Tensor | None:
        """Hidden states [R, block, hidden] of the requests' blocks after the final norm (a view of a static output),
        having appended taps[r]  # [m_r, features] to cache r's context; None where no static shape fits (nothing
        done: the caller runs the dynamic pass). rows: the context rows the program takes (default: the bucket of
        the most rows a request appends)."""
        if any(t is None or t.shape[0] == 0 for t in taps):
            return None
        sizes = [t.shape[0] for t in taps]
        max_len = caches[0].pool.k.shape[2]
        rows = rows or row_bucket(max(sizes))
        reqs = batch_bucket(len(caches)) if self.scratch is not None else len(caches)
        keys = key_bucket(max(c.length + m for c, m in zip(caches, sizes)), max_len)
        fits = keys is not None and max(c.length for c in caches) + rows <= max_len and reqs * rows <= self.MAX_ROWS
        key = ("draft", reqs, rows, keys)
        unprepared = self.graphs.warmed and key not in self.graphs.programs
        if (unprepared or not fits) and rows != self.round_rows and len(caches) > 1:
            # a batch at a context-row bucket warm-up did not make, or too many rows for one program (a catch-up: an
            # `auto` arm drafting after `ar` rounds, whose requests admitted meanwhile bring their prompts' features;
            # a group's first draft after its prompts; a round's accepted tokens at a rare count) takes the program of
            # a round's most rows that warm-up made for its batch size (Engine._warm_batched_drafts): the context
            # before each request's last round_rows rows is written by the dynamic pass first. Otherwise each
            # catch-up length and accepted count would make a program of its own on requests' time (60-70 ms a
            # capture at SmolLM2 dims on the H200, where an `ar` round at 16 streams is 1.5 ms:
            # concurrency_h200_split.md), and a catch-up over MAX_ROWS (padded requests x its row bucket: 17-32
            # requests with one over 64 rows, 9-16 with one over 128) would run the whole drafter pass dynamically, its
            # attention at shapes no warm-up ran
            n = self.round_rows
            after = [c.length + max(0, m - n) for c, m in zip(caches, sizes)]
            if max(after) + n > max_len or reqs * n > self.MAX_ROWS:
                return None
            early = [(cache, t[:-n]) for cache, t in zip(caches, taps) if t.shape[0] > n]
            if early:
                self.drafter.add_contexts([cache for cache, _ in early], [t for _, t in early])
                self.catch_up_rows += sum(t.shape[0] for _, t in early)
            return self.batch(caches, [t[-n:] for t in taps], blocks, rows=n)
        if not fits:
            return None
        program = self.graphs.program(key, lambda: self._make(caches[0].pool, reqs, rows, keys, taps[0]))
        b, host = self.block, program.host.numpy()
        ids, length, m, slot, src = np.split(host, np.cumsum([reqs * b, reqs, reqs, reqs]))
        ids[:], length[:], m[:], src[:] = 0, 0, 0, 0     # padding: empty contexts in the scratch slot
        slot[:] = self.scratch if self.scratch is not None else 0
        offset = 0
        for r, (cache, size) in enumerate(zip(caches, sizes)):
            ids[r * b : (r + 1) * b] = blocks[r]
            length[r], m[r], slot[r] = cache.length, size, cache.slot
            # context row i of request r reads staged row offset + i; rows past its m repeat its first (finite,
            # written beyond the context where nothing reads them before they are overwritten)
            src[r * rows : (r + 1) * rows] = offset
            src[r * rows : r * rows + size] = np.arange(offset, offset + size)
            offset += size
        staged = program.extra["staged"]
        torch.cat(taps, out=staged[:offset])
        hidden = self.graphs.run(key, program)
        for cache, size in zip(caches, sizes):
            cache.length += size
        return hidden[: len(caches)]

    def _make(self, pool, reqs: int, rows: int, keys: int, taps: torch.Tensor) -> Program:
        b = self.block
        host, inputs = self.graphs.new_inputs(reqs * b + 3 * reqs + reqs * rows)
        staged = torch.zeros(reqs * rows, taps.shape[1], dtype=taps.dtype, device=taps.device)
        offsets = torch.arange(max(rows, b), device=inputs.device)

        def body():
            ids, length, m, slots, src = inputs.split([reqs * b, reqs, reqs, reqs, reqs * rows])
            write_pos = (length[:, None] + offsets[:rows]).flatten()
            self.drafter.write_context(pool, slots[:, None].expand(reqs, rows).flatten(), write_pos, staged[src])
            starts = length + m                                       # each root's position = its new context length
            positions = starts[:, None] + offsets[:b]                 # [R, b]
            return self.drafter.forward_pooled(pool, slots, starts, positions, keys, self.embed(ids.view(reqs, b)))

        return Program(body=body, host=host, inputs=inputs, extra={"staged": staged})


__all__ = ["GraphPool", "Program", "StaticCommit", "StaticDrafter", "StaticTarget", "StaticTreeBuild", "batch_bucket", "key_bucket",
           "path_bucket", "row_bucket"]
