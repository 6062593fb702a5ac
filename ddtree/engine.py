"""Engine: continuous batching of requests through draft -> build -> compile -> verify -> accept -> commit.

Every step admits waiting requests into free cache slots (their prompts prefilled together),
then runs one decoding round for every running request: one packed drafter pass, one tree per
request, one packed target verify, and per request the acceptance walk and the commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ddtree.budget import Arm, ArmSelector, CostModel, choose_budgets, default_cost_model, node_weights, parse_arms
from ddtree.config import STATIC_PREFILL_AUTO, EngineConfig
from ddtree.draft_vocab import DraftVocab
from ddtree.errors import InvalidRequest
from ddtree.models.base import to_device
from ddtree.models.dense import KVCache, Segment
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.graphs import (
    MIN_KEYS,
    GraphPool,
    StaticCommit,
    StaticDrafter,
    StaticTarget,
    StaticTreeBuild,
    batch_bucket,
    key_bucket,
    path_bucket,
    prefill_bucket,
    row_bucket,
)
from ddtree.models.loader import dtype_of
from ddtree.models.qwen3_5 import PATHS_MAX_LEN, compact_all
from ddtree.models.target import load_target
from ddtree.profiling import ArmTrace
from ddtree.request import Request, RequestOutput
from ddtree.sampling import probabilities, sample, suppress_tokens
from ddtree.sampling_params import SamplingParams
from ddtree.tree import DraftTree, build_chain, build_tree, compile_tree, top_ids, top_log_probs
from ddtree.tree.build import _add_node, _empty_tree
from ddtree.tree.device import fits_budget
from ddtree.verify import accept

logger = logging.getLogger(__name__)

# Engine.warm_up prepares the static programs of prompts up to this many cache positions (longer ones capture on use).
WARM_UP_MAX_KEYS = 4096
# Time between two decoding rounds beyond this is an idle spell (or a debugger), not serving work (auto's accounting).
MAX_SERVE_GAP_S = 0.5
POLICY_MIN_CAP = 8   # the policy arm's smallest tree-building cap (Engine.policy_cap)
COMMIT_PARTS = ("accept", "caches", "features", "tokens")   # StageTimes.commit_parts
# A request whose target features wait this many rounds for a draft (`auto` on `ar`, the policy's back-off) has them
# written into its drafter context (Engine._fold_contexts): kept, they would grow with the request, ~51 KB a token at
# 27B dims (13 GB for 8 requests of 32K tokens), and the next draft would ingest them all at once
FOLD_CHUNKS = 256


@dataclass(slots=True)
class StageTimes:
    """Wall time per stage in seconds, summed over rounds (synchronized on GPU)."""
    prefill: float = 0.0
    draft: float = 0.0           # packed drafter passes, their lm_head and top-k, read to the host (the read also
    #                              waits for what is left of the last round's commit on the device)
    tree_build: float = 0.0      # best-first trees (and the budget policy) on the host
    verify: float = 0.0          # packed target verify passes
    verify_gpu: float = 0.0      # CUDA: GPU timeline from the verify's start to its last kernel (verify - this: the
    #                              host's wake-up after the GPU finished, e.g. waiting for the GIL)
    draft_gpu: float = 0.0       # CUDA: GPU timeline of the draft stage's device work (drafter pass to the top-k read)
    commit_gpu: float = 0.0      # CUDA: GPU timeline from the commit's start (after the verify's read) to its last kernel
    #                              (accounted a round later: the host does not wait for the commit)
    commit: float = 0.0          # acceptance walks and commits (host time: the commit's device work is not waited for,
    #                              it overlaps what follows, the next round's draft waits for it in stream order)
    commit_parts: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])   # commit's host time by part:
    #                              acceptance walks, cache commits, kept features, token bookkeeping (COMMIT_PARTS)
    decode: float = 0.0          # whole decoding rounds: draft, tree_build, verify, commit and the glue between
    batch_rounds: int = 0        # decoding rounds of the whole batch
    rounds: int = 0              # decoding rounds, summed over requests
    tree_nodes: int = 0          # draft nodes verified (roots excluded)
    draft_passes: int = 0        # packed drafter passes
    dynamic_drafts: int = 0      # of which, with static forwards on, run by the dynamic pass (no static shape fitted)
    dynamic_verifies: int = 0    # verifies that, with static forwards on, ran the dynamic forward (no static shape fitted)
    static_commits: int = 0      # rounds whose cache commit ran as a static program (graphs.StaticCommit)
    device_trees: int = 0        # rounds whose tree was built on the device (one device-to-host read: Engine._round_on_device)
    lookahead_steps: int = 0     # `ar` steps queued before the last one's token was read (Engine._lookahead_round)
    drafts_ahead: int = 0        # drafts launched before their round (config.draft_ahead: Engine._launch_draft_ahead)
    drafts_ahead_undone: int = 0  # of which the next round did not take (undone, or dropped with their request)
    static_prefills: int = 0     # prompts prefilled through a static forward (config.static_prefill)
    folded_rows: int = 0         # pending target features written into drafter contexts ahead of a draft (_fold_contexts)
    acceptance_histogram: dict[int, int] = field(default_factory=dict)   # tokens committed in a drafting round -> rounds
    auto_arm_rounds: dict[str, int] = field(default_factory=dict)   # mode auto: batch rounds per arm it ran (a policy
    #                              round in which no auto request drafted counts as `ar`: ArmSelector.record)
    auto_arm_seconds: dict[str, float] = field(default_factory=dict)   # mode auto: the time charged to each arm's rounds
    #                              (what ArmSelector measures: from the previous round's end, serving work included)

    @property
    def dynamic_forwards(self) -> int:
        """Drafter passes and verifies no static program fitted while static forwards are on."""
        return self.dynamic_drafts + self.dynamic_verifies

    @property
    def host(self) -> float:
        """Round time outside the drafter and target passes (tree build, compile, acceptance, commit)."""
        return self.decode - self.draft - self.verify


@dataclass(slots=True)
class Sequence:
    """A request's decoding state while it holds a cache slot."""
    request: Request
    max_tokens: int
    stop_ids: set[int]
    generator: torch.Generator | None
    slot: int = -1
    root: int = -1                           # last committed token, not yet in the cache
    start: int = 0                           # its position = committed cache length
    # target features of tokens the drafter has not seen, a chunk per round (joined once, when it next drafts): the
    # rows lo:hi of a tensor that holds a whole round's (views are made when they are joined, not per request and round)
    pending_taps: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    skip_rounds: int = 0                     # mode auto: rounds left without drafting (trees did not pay)
    backoff: int = 1                         # mode auto: next skip length after another zero-node round
    calibration: float = 1.0                 # mode auto: observed / drafter-expected accepted nodes (EMA)

    @property
    def depth_limit(self) -> int:
        """Deeper drafts can never be used: the bonus token always adds one."""
        return self.max_tokens - self.request.num_output_tokens - 1


@dataclass(slots=True)
class QueuedStep:
    """Greedy `ar` steps of a batch queued on the device (Engine._queue_step): the target's argmax at each request's
    `start`, copied to the host behind an event."""
    seqs: list[Sequence]
    starts: list[int]
    tokens: torch.Tensor           # [R] on the device: the steps' argmax, the next steps' input ids
    host: torch.Tensor             # [R] on the host (pinned on CUDA), written by the copy the event follows
    event: torch.cuda.Event | None  # None off CUDA (the argmax is on the host already)
    taps: torch.Tensor | None = None   # [R, ...] the steps' target features, the `auto` requests' drafter context

    def matches(self, seqs: list[Sequence]) -> bool:
        """Whether these are the requests it was queued for, in order and where they stand."""
        return len(seqs) == len(self.seqs) and all(a is b and start == b.start
                                                   for a, start, b in zip(self.seqs, self.starts, seqs))

    def read(self) -> list[int]:
        return _read_host(self.host, self.event)


@dataclass(slots=True)
class DraftAhead:
    """A lone greedy request's next draft, launched before its round (Engine._launch_draft_ahead): the drafter's
    hidden states for the request at `start`, the round's plan, and what undoes it (the drafter context's length and
    the pending features before it took them)."""
    seq: Sequence
    start: int
    plan: tuple
    hidden: torch.Tensor
    length: int
    pending: list[tuple[torch.Tensor, int, int]]


@dataclass(slots=True)
class FirstTokens:
    """A prefilled group's greedy first tokens (Engine._greedy_firsts): their argmax copied to the host behind an
    event, read after the step's decoding round (Engine._resolve_firsts), so that the host prepares and launches that
    round while the device runs the prefill instead of waiting for it."""
    seqs: list[Sequence]
    plain: list[int]                     # indices into seqs of the greedy requests that suppress nothing
    host: torch.Tensor | None            # [len(plain)] their tokens (pinned on CUDA), None where there are none
    event: torch.cuda.Event | None       # None off CUDA (the argmax is on the host already)

    def tokens(self) -> list[int | None]:
        """Each request's first token (None: one _start_decoding chose alone)."""
        firsts: list[int | None] = [None] * len(self.seqs)
        if self.host is not None:
            for i, token in zip(self.plain, _read_host(self.host, self.event)):
                firsts[i] = token
        return firsts


def _read_host(host: torch.Tensor, event: torch.cuda.Event | None) -> list[int]:
    """Values copied to the host behind an event (Engine._to_host), once the device has passed it."""
    if event is not None:
        event.synchronize()   # releases the GIL while it waits
    return host.tolist()


class StageEvents:
    """CUDA events at the stage bounds of a round (StageTimes.draft_gpu, verify_gpu, commit_gpu): the GPU timeline
    of a stage, where its device work, not its host time, is the cost. Off CUDA: nothing recorded, 0 seconds."""

    NAMES = ("draft", "drafted", "verify", "verified", "commit", "committed")

    def __init__(self, device: torch.device) -> None:
        self.events = ({name: torch.cuda.Event(enable_timing=True) for name in self.NAMES}
                       if device.type == "cuda" else None)
        self.deferred: list[tuple[str, str, StageTimes, str]] = []

    def record(self, name: str) -> None:
        if self.events is not None:
            self.events[name].record()

    def seconds(self, start: str, end: str) -> float:
        """GPU time between two recorded events (waits for `end`: callers ask after a synchronization)."""
        if self.events is None:
            return 0.0
        self.events[end].synchronize()
        return self.events[start].elapsed_time(self.events[end]) / 1e3

    def defer(self, start: str, end: str, times: StageTimes, stage: str) -> None:
        """Add the GPU time between two events to times.<stage> later (settle), when the device has passed `end`
        anyway: reading it now would make the host wait for work it need not wait for."""
        if self.events is not None:
            self.deferred.append((start, end, times, stage))

    def settle(self) -> None:
        """Account the deferred intervals (before their events are recorded again; waits for them if need be)."""
        for start, end, times, stage in self.deferred:
            setattr(times, stage, getattr(times, stage) + self.seconds(start, end))
        self.deferred.clear()


class _MemoryBudget:
    """Warm-up's programs of one kind, made smallest first while they fit in `mib` MiB: the next one is made only where
    the bytes a row of those made so far say it fits (the first wherever the budget is not 0), so the last one made
    does not overshoot the budget (at 27B dims a group prefill holds ~2.5 MiB a row: one of 8 prompts of 64 rows
    1.3 GB)."""

    def __init__(self, mib: int) -> None:
        self.limit, self.held, self.rows = mib * 2**20, 0, 0

    def fits(self, rows: int) -> bool:
        if self.rows == 0:
            return self.limit > 0
        return self.held + self.held * rows / self.rows <= self.limit

    def add(self, held: int, rows: int) -> None:
        self.held, self.rows = self.held + held, self.rows + rows


def _joined(chunks: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor | None:
    """A request's pending features as one tensor: chunks are (rows of several requests, this one's first, end)."""
    parts = [rows[lo:hi] for rows, lo, hi in chunks]
    return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)


class Engine:
    """Owns the target, the drafter, one cache slot per running request, and the decoding loop."""

    def __init__(self, config: EngineConfig, target=None, drafter: DFlashDrafter | None = None) -> None:
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        dtype, self.device = dtype_of(config.dtype), torch.device(config.device)
        self.target = target or load_target(config.target_path, dtype, config.device)
        if drafter is None and config.drafter_path:
            drafter = DFlashDrafter.from_pretrained(config.drafter_path, dtype, config.device)
        self.drafter = drafter
        self.tap_layers = list(drafter.config.target_layer_ids) if drafter else []
        if drafter is not None:
            if max(self.tap_layers) >= self.target.config.num_hidden_layers:
                raise ValueError(f"drafter taps {self.tap_layers} but the target has "
                                 f"{self.target.config.num_hidden_layers} layers")
            if drafter.config.hidden_size != self.target.config.hidden_size:
                raise ValueError("drafter hidden_size differs from the target's")
        self.draft_vocab = DraftVocab(self.target.lm_head.weight.shape[0], config.draft_vocab,
                                      self.target.eos_token_ids, self.device)
        cache_len = config.max_model_len + config.max_tree_budget + 1
        static = config.static_forward == "on" or (config.static_forward == "auto" and self.device.type == "cuda")
        # static forwards pad a batch's request count with requests that work in one more slot, held by none
        slots = config.max_num_seqs + (1 if static else 0)
        scratch = config.max_num_seqs if static else None
        self.caches = self.target.new_caches(slots, cache_len)
        self.draft_caches = drafter.new_caches(slots, cache_len) if drafter else []
        self.free_slots = list(range(config.max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stage_times = StageTimes()
        self._num_requests = 0
        dims = getattr(self.target, "config", None)
        self.cost_model = CostModel.load(config.cost_model_path or default_cost_model(
            config.device, getattr(dims, "hidden_size", None), getattr(dims, "num_hidden_layers", None)))
        self.arm_selector = ArmSelector(parse_arms(config.auto_arms),
                                        chain_nodes=drafter.block_size - 1 if drafter is not None else 15)
        self.arm_trace = ArmTrace.from_env(self.arm_selector)   # DDTREE_AUTO_TRACE (a diagnostic): off by default
        self.graphs = GraphPool(self.device, capture=config.cuda_graphs)
        self.static_target = StaticTarget(self.target, self.tap_layers, self.graphs, scratch) if static else None
        self.static_drafter = StaticDrafter(drafter, self.target.embed, self.graphs, scratch) if static and drafter else None
        self.static_commit = StaticCommit(self.graphs) if static else None   # a lone hybrid request's replay commit
        graphed = self.device.type == "cuda" and config.cuda_graphs   # what the "auto" settings below turn on with
        # a lone greedy request's tree built on the device, between its static draft and verify
        device_tree = config.device_tree if config.device_tree is not None else graphed
        self.static_tree = (StaticTreeBuild(self.graphs, self.draft_vocab.token_ids) if static and drafter and device_tree
                            else None)
        # a lone request's steps and a batch's (on the H200 in process, SmolLM2 shapes, a batch's queued too: `ar`
        # 1.20-1.54x the tokens/s at 2-32 requests: perf/results/round_profile_h200_lookahead_{true,auto}.md)
        self.ar_lookahead = config.ar_lookahead if config.ar_lookahead is not None else graphed
        draft_ahead = config.draft_ahead if config.draft_ahead is not None else device_tree
        self.draft_ahead = bool(draft_ahead) and self.static_tree is not None
        self._draft_ahead: DraftAhead | None = None
        self.keep_step_taps = os.environ.get("DDTREE_KEEP_STEP_TAPS", "0") not in ("", "0")   # see _queue_step
        self.fold_chunks = FOLD_CHUNKS   # rounds a request's features wait for a draft before _fold_contexts writes them
        static_prefill = config.static_prefill if config.static_prefill is not None else STATIC_PREFILL_AUTO * graphed
        self.static_prefill = static_prefill if self.static_target is not None else 0
        # prefill_bucket rows -> the most prompts one static prefill takes there: set by warm-up (the programs it made
        # within config.static_prefill_memory); None: as many as StaticTarget.MAX_ROWS allows, made on first use
        self._group_sizes: dict[int, int] | None = None
        self.arm: Arm | None = None   # this round's choice for mode "auto" requests
        self.auto_calibration = 1.0
        self.auto_backoff = 1
        # the policy arm builds trees of at most this many nodes (None: the requests' tree_budget): twice the largest
        # budget it chose last round, so that a batch where it keeps a few nodes per request does not build (on the
        # host) and rank 64-node trees for each of them every round, while a budget that fills its cap doubles it
        self.policy_cap: int | None = None
        self._round_end: float | None = None   # when the last step's decoding round ended (None: the last step had none)
        self._events = StageEvents(self.device)
        self._auto_drafted = False   # whether a mode-auto request drafted this round (auto's arm accounting)
        # set while a round's host waits on the device (None: nobody asks): GenerationService's outbox does its
        # Python work inside these windows, not while this thread prepares and launches a round (ddtree.serving.Outbox)
        self.wait_gate: threading.Event | None = None
        self._ahead: QueuedStep | None = None   # ar_lookahead: the running `ar` requests' next steps, queued
        self._firsts: list[FirstTokens] = []    # this step's prefilled groups' first tokens, read after its round

    @property
    def cache(self):
        """Slot 0's cache (single-request tools and tests)."""
        return self.caches[0]

    # -- requests -----------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequest("prompt is empty after tokenization")
        if len(prompt_ids) >= self.config.max_model_len:
            raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; it must be shorter than the context "
                                 f"max_model_len={self.config.max_model_len}")
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab}), got {bad[:4]}")

    def stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids.update(self.target.eos_token_ids)
        return ids

    def add(self, request: Request) -> None:
        """Queue a request; raises InvalidRequest for a prompt or mode this deployment cannot serve."""
        self.check_prompt(request.prompt_ids)
        params = request.params
        if params.mode != "ar" and self.drafter is None:
            raise InvalidRequest(f"mode {params.mode!r} needs a drafter; this deployment serves only 'ar'")
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self.config.seed + self._num_requests
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self._num_requests += 1
        max_tokens = min(params.max_tokens, self.config.max_model_len - len(request.prompt_ids))
        self.waiting.append(Sequence(request, max_tokens, self.stop_ids(params), generator,
                                     calibration=self.auto_calibration, backoff=self.auto_backoff))

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its slot."""
        for seq in list(self.waiting):
            if seq.request.request_id == request_id:
                self.waiting.remove(seq)
                return True
        for seq in self.running:
            if seq.request.request_id == request_id:
                # a queued step of its stays queued (the next step settles the others' steps, skipping its): it runs
                # on a slot nobody reads until a prefill rewrites it, after it in stream order
                self._release(seq)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill), then one decoding round for the others; the admitted requests' first tokens
        are read after that round (_resolve_firsts)."""
        outputs, self._firsts = [], []   # (a step that failed left its groups: their requests were aborted)
        if self._ahead is not None and not (self._lookahead_ok(self.running) and self._ahead.matches(self.running)):
            t_settle = time.perf_counter()
            outputs += self._settle_ahead()   # a request arrives (or the batch changes): the queued steps are a round
            # a round of its own, outside _round: its time is a decoding round's too, else the host time (decode less
            # draft and verify) went down by it, which its counter (ddtree_host_seconds_total) cannot
            self.stage_times.decode += time.perf_counter() - t_settle
        ahead = self._draft_ahead
        if ahead is not None and (ahead.seq.request.finish_reason is not None or not any(s is ahead.seq for s in self.running)):
            self._draft_ahead = None   # its request ended or was aborted: its slot's context is reset by the next prefill
            self.stage_times.drafts_ahead_undone += 1
        decoding = [s for s in self.running if s.request.finish_reason is None]
        t_prefill = time.perf_counter()
        outputs += self._prefill(self._admit())
        prefill_s = time.perf_counter() - t_prefill
        if decoding:
            outputs += self._round(decoding, prefill_s)
        else:
            self._round_end = None
        outputs += self._resolve_firsts()
        for seq in [s for s in self.running if s.request.finish_reason is not None]:
            self._release(seq)
        return outputs

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()

    def _prefill(self, seqs: list[Sequence]) -> list[RequestOutput]:
        if not seqs:
            return []
        t0 = time.perf_counter()
        admitted = seqs
        for seq in admitted:
            seq.request.prefill_start_s = t0
        groups, seqs = self._static_groups(admitted)   # seqs: the prompts longer than self.static_prefill
        outputs = []
        for group in groups:
            done = self._prefill_static(group)
            if done is None:
                seqs += group   # no static program fits: the eager prefill
            else:
                outputs += done
        if not seqs:
            self._prefilled(admitted, t0)
            return outputs
        ids, positions, segments, last_rows = [], [], [], []
        for seq in seqs:
            n = len(seq.request.prompt_ids)
            ids.append(torch.tensor(seq.request.prompt_ids, dtype=torch.long, device=self.device))
            positions.append(torch.arange(n, device=self.device))
            causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            segments.append(Segment.of(self.caches[seq.slot], 0, causal, parents=list(range(-1, n - 1))))
            last_rows.append(sum(s.length for s in segments) - 1)
        logits, taps = self.target.forward_packed(torch.cat(ids), torch.cat(positions), segments, self.tap_layers,
                                                  logit_rows=torch.tensor(last_rows, device=self.device))
        outputs += self._start_group(seqs, [segment.length for segment in segments], logits, taps)
        self._prefilled(admitted, t0)
        return outputs

    def _prefilled(self, seqs: list[Sequence], t0: float) -> None:
        end = time.perf_counter()
        for seq in seqs:
            seq.request.prefill_end_s = end
        self.stage_times.prefill += end - t0

    def _static_groups(self, seqs: list[Sequence]) -> tuple[list[list[Sequence]], list[Sequence]]:
        """The admitted prompts of at most self.static_prefill tokens in the groups that share a static prefill, and the
        others (the eager prefill's). Grouped by prefill_bucket (each prompt padded to at most twice its rows, the group
        to a power of two), each group at most as many as one program takes: up to StaticTarget.MAX_ROWS rows, after
        warm-up the largest group made there (config.static_prefill_memory)."""
        by_rows: dict[int, list[Sequence]] = {}
        others = []
        for seq in seqs:
            n = len(seq.request.prompt_ids)
            if 0 < n <= self.static_prefill:
                by_rows.setdefault(prefill_bucket(n), []).append(seq)
            else:
                others.append(seq)
        size = {rows: self._group_sizes.get(rows, 1) if self._group_sizes is not None else
                max(1, StaticTarget.MAX_ROWS // rows) for rows in by_rows}
        groups = [group[i : i + size[rows]] for rows, group in by_rows.items() for i in range(0, len(group), size[rows])]
        return groups, others

    def _greedy_firsts(self, seqs: list[Sequence], logits: torch.Tensor) -> FirstTokens:
        """The first tokens of the prefilled greedy requests that suppress nothing (min_tokens 0), from their last rows'
        logits  # [len(seqs), vocab], in one argmax and one copy to the host for the group, not read here (no wait
        for the prefill: FirstTokens); the others' _start_decoding chooses one by one."""
        plain = [i for i, seq in enumerate(seqs)
                 if seq.request.params.is_greedy and not self._suppressed(seq.request.params)]
        if not plain:
            return FirstTokens(seqs, [], None, None)
        picked = logits[plain] if len(plain) < len(seqs) else logits   # all of them: no gathered copy
        return FirstTokens(seqs, plain, *self._to_host(picked.argmax(dim=-1)))

    def _start_group(self, seqs: list[Sequence], lengths: list[int], logits: torch.Tensor,
                     taps: torch.Tensor | None) -> list[RequestOutput]:
        """A prefilled group (prompts of these lengths, their last rows' logits  # [len(seqs), vocab], their features
        packed in order): each prompt committed; the greedy requests' first tokens queued for _resolve_firsts, the
        others' chosen and reported here."""
        firsts = self._greedy_firsts(seqs, logits)
        deferred = set(firsts.plain)
        outputs, row = [], 0
        for i, (seq, n) in enumerate(zip(seqs, lengths)):
            output = self._start_decoding(seq, n, logits[i : i + 1], taps, row, deferred=i in deferred)
            if output is not None:
                outputs.append(output)
            row += n
        if deferred:
            self._firsts.append(firsts)
        return outputs

    def _start_decoding(self, seq: Sequence, n: int, logits: torch.Tensor, taps: torch.Tensor | None,
                        row: int, deferred: bool = False) -> RequestOutput | None:
        """A prefilled prompt of n tokens committed, its first token chosen from the last row's logits  # [1, vocab]
        (deferred: chosen with its group's, _greedy_firsts, and reported by _resolve_firsts: None here); its features
        (taps rows row..row+n) pending for the drafter."""
        self.caches[seq.slot].compact(0, list(range(n)))   # commits the whole prompt (recurrent state too)
        params = seq.request.params
        seq.start = n
        seq.pending_taps = [(taps, row, row + n)] if taps is not None and params.mode != "ar" else []
        if self.draft_caches:
            self.draft_caches[seq.slot].length = 0
        if deferred:
            return None
        suppressed = self._suppressed(params)   # min_tokens: EOS kept out of the first token
        if suppressed:
            logits = suppress_tokens(logits, suppressed, torch.tensor([True], device=self.device))
        seq.root = self._choose(logits[0], params, seq.generator)
        return self._commit(seq, [seq.root], accepted_length=None)

    def _resolve_firsts(self) -> list[RequestOutput]:
        """The first tokens of the greedy requests this step prefilled, read (one wait a group, after the step's round:
        in stream order the device ran the prefill before that round, so the wait is mostly over) and reported; their
        prefill_end_s is when their first token is known."""
        pending, self._firsts = self._firsts, []
        outputs = []
        for firsts in pending:
            with self._waiting():
                tokens = firsts.tokens()
            now = time.perf_counter()
            for seq, token in zip(firsts.seqs, tokens):
                if token is not None:
                    seq.root = token
                    seq.request.prefill_end_s = now
                    outputs.append(self._commit(seq, [token], accepted_length=None))
        return outputs

    def _prefill_static(self, seqs: list[Sequence]) -> list[RequestOutput] | None:
        """Prompts admitted together (each of at most self.static_prefill tokens) through one static forward, as chains
        of rows from position 0 (a program per row bucket and group size that serves every slot: on CUDA a graph replay
        instead of ~60 torch calls a layer, for one prompt or 32); None where no static program fits (the eager prefill
        runs)."""
        prompts = [seq.request.prompt_ids for seq in seqs]
        # staged: a step may run two groups of one program (a bucket's prompts over its group size) without waiting
        result = self.static_target.batch([self.caches[seq.slot] for seq in seqs], [0] * len(seqs), prompts,
                                          [list(range(len(p))) for p in prompts],
                                          [list(range(-1, len(p) - 1)) for p in prompts], staged=True, prefill=True)
        if result is None:
            return None
        logits, taps = result   # logits: each prompt's last row's alone
        # the features are views of the program's outputs, which another static forward of its shape would overwrite
        # before the drafter reads them (an `auto` request's `ar` rounds at the same rows): a copy of their own
        drafting = taps is not None and any(seq.request.params.mode != "ar" for seq in seqs)
        taps = taps.clone() if drafting else None
        outputs = self._start_group(seqs, [len(p) for p in prompts], logits, taps)
        self.stage_times.static_prefills += len(seqs)
        return outputs

    def _round(self, seqs: list[Sequence], prefill_s: float = 0.0) -> list[RequestOutput]:
        times, t_round = self.stage_times, time.perf_counter()
        cycle_start = self._cycle_start(t_round, prefill_s)
        budgets = [s.request.params.tree_budget for s in seqs if s.request.params.mode == "auto"]
        if budgets:   # arms above the requests' budgets, or whose trees or chains no made verify takes, left out
            made = self._made_tree_nodes(seqs)
            self.arm = (self.arm_selector.choose(len(seqs), max(budgets)) if made is None else
                        self.arm_selector.choose(len(seqs), min(max(budgets), made),
                                                 chain=self.drafter is not None and made >= self.drafter.block_size - 1))
        else:
            self.arm = None
        late = len(self.graphs.late_keys)
        settled = []
        if self._ahead is not None and not (self._lookahead_ok(seqs) and self._ahead.matches(seqs)):
            # `auto` requests' step queued on the `ar` arm, and this round's arm is another: the step is a round
            settled = self._settle_ahead()
            seqs = [s for s in seqs if s.request.finish_reason is None]
            if not seqs:
                return settled
        outputs = self._lookahead_round(seqs) if self._lookahead_ok(seqs) else None
        if outputs is None:
            ahead = self._take_draft_ahead(seqs)
            plan = ahead.plan if ahead is not None else self._device_tree_plan(seqs)
            if plan is not None:
                trees, verified = self._round_on_device(seqs[0], *plan, ahead=ahead)
                batches = []
            else:
                trees, verified = self._draft(seqs), None
                batches = [compile_tree(tree, seq.root, seq.start) for seq, tree in zip(seqs, trees)]
            times.tree_nodes += sum(tree.num_nodes for tree in trees)
            outputs = self._verify_and_commit(seqs, trees, batches, verified)
        self._fold_contexts(seqs)
        now = time.perf_counter()
        if self.arm is not None:   # measured tokens/s of this round's choice for the auto requests
            produced = sum(len(out.new_token_ids) for seq, out in zip(seqs, outputs) if seq.request.params.mode == "auto")
            ran = self.arm_selector.record(len(seqs), self.arm, produced, now - cycle_start, drafted=self._auto_drafted,
                                           made_programs=len(self.graphs.late_keys) > late)
            times.auto_arm_rounds[ran.name] = times.auto_arm_rounds.get(ran.name, 0) + 1
            times.auto_arm_seconds[ran.name] = times.auto_arm_seconds.get(ran.name, 0.0) + now - cycle_start
        self._round_end = now
        times.decode += now - t_round
        times.batch_rounds += 1
        return settled + outputs

    def _cycle_start(self, t_round: float, prefill_s: float) -> float:
        """Where the time `auto` charges to this round starts: the previous round's end, less this step's prefill,
        when the rounds follow each other (a serving loop's per-round work between steps, streaming the outputs and
        checking cancellations, is paid once per round whatever the arm, so an arm that commits more tokens per round
        pays it less often; charging only the round itself, auto ran `ar` at one stream on the H200 where `ddtree-16` was
        15% faster end to end); the round's own start after an idle spell, or when the gap is far longer than any serving work."""
        if self._round_end is None:
            return t_round
        start = self._round_end + prefill_s
        return start if start <= t_round and t_round - start < MAX_SERVE_GAP_S else t_round

    def _verify_and_commit(self, seqs: list[Sequence], trees: list[DraftTree], batches: list,
                           verified: tuple | None = None) -> list[RequestOutput]:
        """One target pass over the requests' trees, then each one's acceptance walk and commit; verified: the
        pass's (logits, taps, greedy choices) where the round ran it already (_round_on_device)."""
        times, t_verify = self.stage_times, time.perf_counter()
        if verified is not None:
            logits, taps, choices = verified
        else:
            self._events.record("verify")
            logits, taps = self._verify(seqs, trees, batches)
            self._events.record("verified")
            # the target's greedy choices of every row, launched behind the verify and read in the same wait: one
            # device-to-host read after the verify (rows of requests that sample or suppress tokens are recomputed per request)
            greedy = any(s.request.params.is_greedy for s in seqs)
            with self._waiting():
                choices = logits.argmax(dim=-1).tolist() if greedy else None
                if not greedy:
                    self._sync()
        t_commit = time.perf_counter()
        self._events.settle()   # the last round's commit: the device has passed it
        times.verify_gpu += self._events.seconds("verify", "verified")
        self._events.record("commit")
        accepted, starts, row = [], [], 0
        for seq, tree in zip(seqs, trees):
            rows = slice(row, row + tree.num_nodes + 1)
            accepted.append(self._accept(seq, tree, logits[rows], None if choices is None else choices[rows]))
            starts.append(row)
            row = rows.stop
        t_accepted = time.perf_counter()
        parts = times.commit_parts   # the stage's host time by part: they add up to it
        parts[0] += t_accepted - t_commit
        # the features kept, this round's cache commit, the requests advanced (and, drafting ahead, the next round's
        # draft launched: the device drafts while the host reports and starts the next round). The features first:
        # the verify's taps are an output of the graphs' shared pool (GraphPool), valid only until the next replay of
        # any program, and the commit may replay one (until the 26th session the commit went first without the draft
        # ahead). The commit before the requests advance, so that its device work runs under their bookkeeping, and
        # before the draft: it reads the verify's stash (a hybrid's GDN inputs of every row), also a pool output, which
        # the drafter's replay may overwrite (launched the other way round until the 25th session, a CPU test with the
        # stash overwritten as the draft starts decodes wrong tokens)
        paths = [a.accepted for a in accepted]
        self._keep_taps(seqs, paths, taps, starts)
        t_features = time.perf_counter()
        self._commit_caches(seqs, paths)
        self._events.record("committed")   # the commit's GPU time alone (a draft queued after it is the draft's)
        t_caches = time.perf_counter()
        outputs = [self._advance(seq, tree, acceptance) for seq, tree, acceptance in zip(seqs, trees, accepted)]
        t_end = time.perf_counter()   # the commit stage's host time, less a draft's launch
        parts[1] += t_caches - t_features
        parts[2] += t_features - t_accepted
        parts[3] += t_end - t_caches
        if self.draft_ahead and verified is not None:
            self._launch_draft_ahead(seqs)
            times.draft += time.perf_counter() - t_end
        # not waited for: the commit's device work (K/V row moves, a hybrid's recurrent replay) runs while the host
        # reports this round and starts the next; the next round's reads wait for it in stream order
        self._events.defer("commit", "committed", times, "commit_gpu")
        times.verify += t_commit - t_verify
        times.commit += t_end - t_commit
        return outputs

    def _verify(self, seqs: list[Sequence], trees: list[DraftTree], batches: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass over every request's tree: logits and taps of all rows, packed in request order; through
        the static forward where one fits (a CUDA graph replay on CUDA)."""
        if self.static_target is not None:
            result = self.static_target.batch([self.caches[s.slot] for s in seqs], [s.start for s in seqs],
                                              [b.input_ids for b in batches], [b.positions for b in batches],
                                              [t.parents for t in trees])
            if result is not None:
                return result
            self.stage_times.dynamic_verifies += 1
        segments = [Segment.of(self.caches[seq.slot], seq.start, b.visibility.to(self.device), parents=tree.parents)
                    for seq, tree, b in zip(seqs, trees, batches)]
        ids = torch.cat([b.input_ids for b in batches]).to(self.device)
        positions = torch.cat([b.positions for b in batches]).to(self.device)
        return self.target.forward_packed(ids, positions, segments, self.tap_layers)

    def _accept(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor, greedy_choice: list[int] | None):
        """The acceptance walk of one request's tree (its rows' logits; the greedy choices where read)."""
        params = seq.request.params
        suppressed = self._suppressed(params)
        if suppressed:
            depth = torch.tensor(tree.depths, device=self.device)
            logits = suppress_tokens(logits, suppressed, seq.request.num_output_tokens + depth < params.min_tokens)
            greedy_choice = None
        acceptance = accept(tree, logits, params, seq.generator, greedy_choice)
        if params.mode == "auto" and self.arm is not None and self.arm.mode == "policy" and tree.num_nodes:
            # the drafter's own weights are its belief; scale them by how often that belief held
            expected = float(node_weights(tree.log_weights[1:]).sum())
            observed = (len(acceptance.accepted) - 1 + 0.1) / (expected + 0.1)
            seq.calibration = 0.5 * seq.calibration + 0.5 * min(observed, 1.0)
            self.auto_calibration = 0.5 * self.auto_calibration + 0.5 * seq.calibration   # prior for new requests
        return acceptance

    def _fold_contexts(self, seqs: list[Sequence]) -> None:
        """Once a running request's target features have waited self.fold_chunks rounds for a draft, those of every
        request waiting over a quarter of that are written into their drafter contexts, all but each one's newest row
        (its next draft appends at least one, a shape warm-up made), in one dynamic context write: about once every
        fold_chunks rounds, their memory bounded and a later draft's catch-up short. The drafter's context is the same
        either way (the same features at the same positions)."""
        if self.drafter is None or not any(len(s.pending_taps) >= self.fold_chunks for s in seqs):
            return
        fold = [s for s in seqs if len(s.pending_taps) > max(1, self.fold_chunks // 4) and s.request.finish_reason is None]
        if not fold:
            return
        taps = [_joined(s.pending_taps) for s in fold]
        self.drafter.add_contexts([self.draft_caches[s.slot] for s in fold], [t[:-1] for t in taps])
        for seq, t in zip(fold, taps):
            seq.pending_taps = [(t[-1:].clone(), 0, 1)]   # its own row: the joined rows are freed
        self.stage_times.folded_rows += sum(t.shape[0] - 1 for t in taps)

    # -- `ar` lookahead (config.ar_lookahead) ----------------------------------------------
    def _lookahead_ok(self, seqs: list[Sequence]) -> bool:
        """Whether this round is greedy `ar` steps (`ar` requests', or `auto` requests' on the `ar` arm) that may queue
        the next before reading their tokens. A step that admits requests keeps the queued steps of the others: the
        prefill runs after them on the device without a wait (its first tokens are read after the round: FirstTokens),
        and their round consumes them."""
        if not self.ar_lookahead or self.static_target is None or not seqs:
            return False
        on_ar = self.arm is not None and self.arm.mode == "ar"
        return all((p.mode == "ar" or (p.mode == "auto" and on_ar)) and p.is_greedy and not self._suppressed(p)
                   for p in (s.request.params for s in seqs))

    def _lookahead_round(self, seqs: list[Sequence]) -> list[RequestOutput] | None:
        """One `ar` step of greedy requests, the next one queued behind it before their tokens are read: the next
        step's input ids are this step's argmax, copied on the device, so the device runs the steps back to back while
        the host reads, reports and prepares (an `ar` step's acceptance is its root alone and its commit moves no row:
        nothing in it waits for the host). The queued step is kept while the requests go on, consumed by the next
        round, or settled as a round of its own (_settle_ahead) when the batch changes (an arrival, a request that
        stopped or was aborted: the others' tokens are read, its skipped) or an `auto` request's arm does. A stopped
        request's queued row writes past its committed tokens, on a slot nobody reads until a prefill rewrites it.
        None: no static program fits (the round runs the usual way)."""
        times, t0 = self.stage_times, time.perf_counter()
        step, self._ahead = self._ahead, None
        if step is None or not step.matches(seqs):
            step = self._queue_step(seqs, [seq.root for seq in seqs], [seq.start for seq in seqs])
            if step is None:
                return None
        following = None
        if all(seq.request.num_output_tokens + 1 < seq.max_tokens for seq in seqs):   # room for a token after these
            following = self._queue_step(seqs, step.tokens, [start + 1 for start in step.starts])
        with self._waiting():
            tokens = step.read()
        t2 = time.perf_counter()
        outputs = self._advance_steps(step, tokens, range(len(seqs)))
        if any(output.finish_reason is None for output in outputs):
            self._ahead = following
        times.lookahead_steps += following is not None
        times.verify += t2 - t0   # queueing the steps, then the wait for these tokens
        times.commit += time.perf_counter() - t2
        return outputs

    def _queue_step(self, seqs: list[Sequence], tokens: list[int] | torch.Tensor, starts: list[int]) -> QueuedStep | None:
        """Queue an `ar` step of these requests at `starts` (their input ids from the host, or on the device: the last
        queued step's argmax), its commit, and its argmax's copy to the host; None where no static program fits."""
        on_device = isinstance(tokens, torch.Tensor)
        n = len(seqs)
        ids = [[0] for _ in seqs] if on_device else [[token] for token in tokens]
        result = self.static_target.batch([self.caches[seq.slot] for seq in seqs], starts, ids,
                                          [[start] for start in starts], [[-1]] * n,
                                          tree=(tokens, None) if on_device else None, staged=True)
        if result is None:
            return None
        self._commit_caches(seqs, [[0]] * n, starts)
        argmax = result[0][:n].argmax(dim=-1)
        # `auto` requests keep their steps' features for the drafter (copied out: the next step reuses the buffers);
        # DDTREE_KEEP_STEP_TAPS=1 (a diagnostic) copies them for `ar` batches too, unused: what that copy costs `ar`
        drafting = result[1] is not None and (self.keep_step_taps
                                              or any(seq.request.params.mode != "ar" for seq in seqs))
        taps = result[1][:n].clone() if drafting else None
        return QueuedStep(seqs, starts, argmax, *self._to_host(argmax), taps)

    def _advance_steps(self, step: QueuedStep, tokens: list[int], which) -> list[RequestOutput]:
        """The queued step's tokens committed to these of its requests (and, for `auto`, their features to the
        drafter's context)."""
        outputs = []
        for i in which:
            seq, token = step.seqs[i], tokens[i]
            if step.taps is not None and seq.request.params.mode != "ar":
                seq.pending_taps.append((step.taps, i, i + 1))
            # _advance of an acceptance that is its root alone, without the empty tree and the Acceptance it would
            # take: two objects a request and step, at 32 requests where the host paces the rounds (c=32 above)
            seq.start += 1
            seq.root = token
            outputs.append(self._commit(seq, [token], 1, drafted=False))
        return outputs

    def _settle_ahead(self) -> list[RequestOutput]:
        """The queued `ar` step as a round of its own (before a round that would decode its requests the usual way),
        for those of its requests still running where it left them."""
        step, self._ahead = self._ahead, None
        live = [i for i, seq in enumerate(step.seqs) if seq.request.finish_reason is None and step.starts[i] == seq.start
                and any(s is seq for s in self.running)]
        if not live:
            return []
        t0 = time.perf_counter()
        with self._waiting():
            tokens = step.read()
        outputs = self._advance_steps(step, tokens, live)
        self.stage_times.verify += time.perf_counter() - t0
        self.stage_times.batch_rounds += 1
        return outputs

    def _commit_caches(self, seqs: list[Sequence], accepted: list[list[int]], starts: list[int] | None = None) -> None:
        """Move each request's accepted rows to its committed prefix: for a dense target one gather and one scatter
        over the whole KV pool for all of them (per request, that was an index copy and two kernels); a hybrid
        cache also commits its recurrent state (for a batch of trees on our paths kernel in one replay for all; for a
        lone request after a static verify as a static program). starts: where each request's rows begin (default:
        its committed length)."""
        caches = [self.caches[seq.slot] for seq in seqs]
        starts = [seq.start for seq in seqs] if starts is None else starts
        if isinstance(caches[0], KVCache):
            caches[0].pool.move_rows([(c.slot, start, a) for c, start, a in zip(caches, starts, accepted)])
            return
        if self.static_commit is not None and len(caches) == 1 and self.static_commit(caches[0], starts[0], accepted[0]):
            self.stage_times.static_commits += 1
            return
        compact_all(caches, starts, accepted)

    def _keep_taps(self, seqs: list[Sequence], accepted: list[list[int]], taps: torch.Tensor | None,
                   starts: list[int]) -> None:
        """The drafter's next context: the accepted rows' target features, gathered for all requests at once (an
        `ar` request never drafts: its features are not kept; a round without drafting leaves earlier features
        unseen, so they accumulate)."""
        keep = [i for i, seq in enumerate(seqs) if seq.request.params.mode != "ar"]
        if taps is None or not keep:
            return
        rows = [starts[i] + r for i in keep for r in accepted[i]]
        if rows[-1] - rows[0] == len(rows) - 1 and len(rows) == len(keep):
            # one row each, in order (a round where nobody drafted, e.g. `auto` on `ar`): a slice copied out of the
            # verify's outputs (static buffers on CUDA), no index built on the host and sent to the device
            kept = taps[rows[0] : rows[-1] + 1].clone()
        else:
            kept = taps[to_device(torch.tensor(rows), self.device)]
        lo = 0
        for i in keep:
            hi = lo + len(accepted[i])
            seqs[i].pending_taps.append((kept, lo, hi))
            lo = hi

    def _advance(self, seq: Sequence, tree: DraftTree, acceptance) -> RequestOutput:
        new_tokens = [tree.tokens[i] for i in acceptance.accepted[1:]] + [acceptance.bonus_token]
        seq.start += len(acceptance.accepted)
        seq.root = acceptance.bonus_token
        return self._commit(seq, new_tokens, len(acceptance.accepted), drafted=tree.num_nodes > 0)

    def _draft(self, seqs: list[Sequence]) -> list[DraftTree]:
        """One packed drafter pass for the requests that speculate; their trees (empty for the others)."""
        trees = [_empty_tree() for _ in seqs]
        # a round of `auto` on `ar`: only requests of the drafting modes can draft (no per-request test of the others)
        skip = ("ar", "auto") if self.arm is not None and self.arm.mode == "ar" else ("ar",)
        drafting = [i for i, s in enumerate(seqs) if s.request.params.mode not in skip and self._drafts_this_round(s)]
        self._auto_drafted = any(seqs[i].request.params.mode == "auto" for i in drafting)
        if not drafting:
            return trees
        t0 = time.perf_counter()
        self._events.record("draft")
        self.stage_times.draft_passes += 1
        block = self.drafter.block_size
        hidden = self._draft_hidden([seqs[i] for i in drafting])
        # one lm_head pass, one top-k and one device-to-host copy for every drafting request (device work of the
        # draft stage: the lm_head streams the target's whole output matrix, ~0.6 ms at 27B dims on an H200)
        depth = min(block - 1, max(seqs[i].depth_limit for i in drafting))
        draft_logits = self.draft_logits(hidden[:, 1 : 1 + depth], [seqs[i].request for i in drafting])  # [R, depth, V]
        plans = {i: self._draft_plan(seqs[i]) for i in drafting}               # (chain?, budget)
        k = min(max(1 if chain else budget for chain, budget in plans.values()), draft_logits.shape[-1])
        with self._waiting():
            if all(chain for chain, _ in plans.values()):   # chains only: their tokens, no log-probabilities
                log_probs, token_ids = None, top_ids(draft_logits)             # [R, depth, 1] on the host (a sync)
            else:
                log_probs, token_ids = top_log_probs(draft_logits, k)          # [R, depth, k] on the host (a sync)
        token_ids = self.draft_vocab.token_ids(token_ids)
        t1 = time.perf_counter()
        self._events.record("drafted")   # after the read: the GPU is idle, the event completes at once
        self.stage_times.draft_gpu += self._events.seconds("draft", "drafted")
        for j, i in enumerate(drafting):
            (chain, budget), d = plans[i], min(seqs[i].depth_limit, depth)
            if chain:
                trees[i] = build_chain(token_ids[j, :d, 0].tolist())
            else:
                kb = min(budget, k)
                trees[i] = build_tree(log_probs[j, :d, :kb], token_ids[j, :d, :kb], budget)
        self._apply_budget_policy(seqs, trees)
        self.stage_times.draft += t1 - t0
        self.stage_times.tree_build += time.perf_counter() - t1
        return trees

    def _draft_hidden(self, seqs: list[Sequence]) -> torch.Tensor:
        """The drafter's pass for these requests (their pending features join its context first): the hidden states
        of their blocks  # [R, block, hidden], through the static pass where one fits."""
        drafter, block = self.drafter, self.drafter.block_size
        caches = [self.draft_caches[seq.slot] for seq in seqs]
        taps = [_joined(seq.pending_taps) for seq in seqs]
        blocks = [[seq.root] + [drafter.config.mask_token_id] * (block - 1) for seq in seqs]
        hidden = None
        if self.static_drafter is not None:
            hidden = self.static_drafter.batch(caches, taps, blocks)
        if hidden is None:
            self.stage_times.dynamic_drafts += self.static_drafter is not None
            drafter.add_contexts(caches, taps)
            hidden = drafter.forward_packed(caches, self.target.embed(torch.tensor(blocks, device=self.device)),
                                            [seq.start for seq in seqs])
        for cache, seq in zip(caches, seqs):
            assert cache.length == seq.start, "drafter context out of step with the target"
            seq.pending_taps = []
        return hidden

    def _device_tree_plan(self, seqs: list[Sequence]) -> tuple[int, int, int, int, tuple[int, int]] | None:
        """(k, budget, depth, nodes, (rows, paths)) of a round that builds its tree on the device (_round_on_device): a lone
        greedy request of a drafting mode (`auto` on a dflash or ddtree arm: the policy arm reads the tree's weights
        before its verify) whose verify has a static program that takes its tree from the device; None: the host
        path (_draft)."""
        if self.static_tree is None or len(seqs) != 1:
            return None
        seq = seqs[0]
        params = seq.request.params
        if not params.is_greedy or self._suppressed(params) or params.mode == "ar":
            return None
        if params.mode == "auto" and self.arm.mode not in ("dflash", "ddtree"):
            return None
        depth = min(self.drafter.block_size - 1, seq.depth_limit)
        if depth <= 0:
            return None
        chain, budget = self._draft_plan(seq)
        k = 1 if chain else min(budget, self.draft_vocab.width)
        budget = depth if chain else budget
        nodes = fits_budget(depth, k, budget)
        shape = self.static_target.device_tree_shape(self.caches[seq.slot], seq.start, nodes + 1)
        if shape is None or k >= shape[0] or (shape[1] and self.drafter.block_size > PATHS_MAX_LEN):
            return None
        return k, budget, depth, nodes, shape

    def _round_on_device(self, seq: Sequence, k: int, budget: int, depth: int, nodes: int, shape: tuple[int, int],
                         ahead: DraftAhead | None = None) -> tuple[list[DraftTree], tuple]:
        """A lone greedy request's draft, tree and verify queued back to back, read once: the draft's top-k, the tree
        build and the verify's tree inputs stay on the device (graphs.StaticTreeBuild), and the verify's choices come
        back with the tree they answer (on the host path the draft's top-k is read before the tree build, a second
        read and a GPU idle while the host builds the tree and launches the verify). Returns ([tree], the verify's
        (logits, taps, choices)). ahead: its draft, launched before this round (_launch_draft_ahead): the draft
        stage's GPU timeline then spans the last round's commit, queued behind the draft."""
        times, t0 = self.stage_times, time.perf_counter()
        if ahead is None:
            self._events.record("draft")
        times.draft_passes += 1
        times.device_trees += 1
        self._auto_drafted = seq.request.params.mode == "auto"
        n = nodes + 1
        hidden = self._draft_hidden([seq]) if ahead is None else ahead.hidden
        # the whole block's depths (one program per block depth: the tree takes the first `depth`); the draft's
        # logits and top-k run inside the tree's program
        head, paths = self.static_tree(hidden[0, 1:], self._draft_head([seq.request]), k, budget, depth, seq.root,
                                       seq.start, *shape)                                   # [3, rows]
        self._events.record("drafted")
        t1 = time.perf_counter()
        self._events.record("verify")
        cache = self.caches[seq.slot]
        logits, taps = self.static_target.batch([cache], [seq.start], [[0] * n], [[seq.start] * n], [[-1] * n],
                                                tree=(head, paths))
        self._events.record("verified")
        # the round's one device-to-host read: the verify's choices, the tree's ids, positions and parents
        with self._waiting():
            read = torch.cat([logits.argmax(dim=-1), head[:, :n].flatten()]).tolist()
        t2 = time.perf_counter()
        choices, ids, positions, parents = (read[i * n : (i + 1) * n] for i in range(4))
        tree = _empty_tree()
        for node in range(1, n):
            _add_node(tree, ids[node], parents[node], positions[node] - seq.start)
        times.draft += t1 - t0
        times.draft_gpu += self._events.seconds("draft", "drafted")
        times.verify += t2 - t1
        times.tree_build += time.perf_counter() - t2
        return [tree], (logits, taps, choices)

    def _launch_draft_ahead(self, seqs: list[Sequence]) -> None:
        """After a device round's acceptance (the request advanced, its features pending), its next draft launched at
        once (config.draft_ahead): a lone greedy `dflash` or `ddtree` request still running whose next round builds its
        tree on the device, with no request waiting for a free slot (the next step would admit it). The drafter's pass
        appends the pending features to its context and drafts the block; what it leaves, the next round takes
        (_take_draft_ahead) or undoes."""
        if len(seqs) != 1 or (self.waiting and self.free_slots):   # a request about to join the batch
            return
        seq = seqs[0]
        if seq.request.finish_reason is not None or seq.request.params.mode not in ("dflash", "ddtree"):
            return
        plan = self._device_tree_plan(seqs)
        if plan is None:
            return
        cache = self.draft_caches[seq.slot]
        length, pending = cache.length, list(seq.pending_taps)
        self._events.record("draft")
        # a copy: the drafter program's output lies in the graphs' shared pool, valid only until the next replay of any
        # program (GraphPool), and other programs may replay before the next round's tree program reads it (on the H100
        # a round with drafts ahead decoded a wrong token, this or the commit's stash read after the draft's replay:
        # draft_ahead_switches_h100_0d7f4dc.log)
        hidden = self._draft_hidden(seqs).clone()
        self._draft_ahead = DraftAhead(seq, seq.start, plan, hidden, length, pending)
        self.stage_times.drafts_ahead += 1

    def _take_draft_ahead(self, seqs: list[Sequence]) -> DraftAhead | None:
        """The draft launched ahead for this round (the same lone request where it stood), or None: a draft ahead of
        another batch is undone first (the drafter's context length and the request's pending features put back: its
        next draft writes the same context rows again)."""
        ahead, self._draft_ahead = self._draft_ahead, None
        if ahead is None:
            return None
        if len(seqs) == 1 and seqs[0] is ahead.seq and ahead.seq.start == ahead.start:
            return ahead
        self.draft_caches[ahead.seq.slot].length = ahead.length
        ahead.seq.pending_taps = ahead.pending + ahead.seq.pending_taps
        self.stage_times.drafts_ahead_undone += 1
        return None

    def _draft_plan(self, seq: Sequence) -> tuple[bool, int]:
        """(draft a chain?, tree budget) of a drafting request this round; auto requests follow the round's arm."""
        params = seq.request.params
        mode = params.mode if params.mode != "auto" else self.arm.mode
        if mode == "dflash":
            return True, 1
        if mode == "ddtree" and params.mode == "auto":
            return False, min(self.arm.budget, params.tree_budget)
        if params.mode == "auto" and self.policy_cap is not None:   # the policy arm (cut below by _apply_budget_policy)
            return False, min(params.tree_budget, self.policy_cap)
        return False, params.tree_budget   # ddtree, and the policy arm's first round

    def _made_tree_nodes(self, seqs: list[Sequence]) -> int | None:
        """The most nodes each of these requests' trees may have to verify through a program warm-up made (None: no
        limit): `auto` builds no larger one, whose program would be made on the round's time, a stall of every stream
        (162 ms at 29 requests on an H100: concurrency_h100_child_c32_split.md)."""
        if self.static_target is None or len(seqs) < 2:
            return None
        made = self.static_target.made_tree_rows(len(seqs), max(s.start for s in seqs), self.caches[0].max_len)
        return None if made is None else max(made - 1, 0)

    def _apply_budget_policy(self, seqs: list[Sequence], trees: list[DraftTree]) -> None:
        """Mode "auto" on the policy arm: cut each request's tree to the nodes that pay this round (ddtree.budget)."""
        if self.arm is None or self.arm.mode != "policy":
            return
        auto = [i for i, s in enumerate(seqs) if s.request.params.mode == "auto" and trees[i].num_nodes]
        if not auto:
            return
        other_rows = sum(1 + trees[i].num_nodes for i in range(len(seqs)) if i not in auto)
        weights = [node_weights(trees[i].log_weights[1:]) * seqs[i].calibration for i in auto]
        limits = [trees[i].num_nodes for i in auto]
        made = self._made_tree_nodes(seqs)
        if made is not None:
            limits = [min(n, made) for n in limits]
        budgets = choose_budgets(weights, self.cost_model, limits, fixed_rows=other_rows)
        self.policy_cap = max(POLICY_MIN_CAP, 2 * max(budgets))
        for i, budget in zip(auto, budgets):
            trees[i] = trees[i].truncated(budget)
            seq = seqs[i]
            if budget == 0:   # not worth a tree now: skip drafting for a while (1, 2, 4 ... 64 rounds), then probe
                seq.skip_rounds, seq.backoff = seq.backoff, min(2 * seq.backoff, 64)
            else:
                seq.backoff = 1
            self.auto_backoff = seq.backoff   # new requests start where the last decision left off

    def _drafts_this_round(self, seq: Sequence) -> bool:
        """Whether a request of a mode that drafts this round (_draft leaves out `ar`, and `auto` on an `ar` round)
        drafts: not past its last token, not backing off on the policy arm."""
        if seq.depth_limit <= 0:
            return False
        if seq.request.params.mode == "auto" and self.arm.mode == "policy" and seq.skip_rounds > 0:
            seq.skip_rounds -= 1   # the policy found no tree worth it lately: back off
            return False
        return True

    def draft_logits(self, hidden: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Drafter outputs -> logits through the target's lm_head over the draft vocabulary (ddtree.draft_vocab:
        positions in it, which draft_vocab.token_ids maps to token ids); hidden  # [R, depth, hidden] ->
        [R, depth, draft_vocab.width]"""
        return self.draft_vocab.logits(self.target.lm_head, hidden)

    def _draft_head(self, requests: list[Request]) -> Callable[[torch.Tensor], torch.Tensor]:
        """draft_logits for one request's hidden states  # [depth, hidden] -> [depth, draft_vocab.width] (the tree
        program's head: StaticTreeBuild)."""
        return lambda hidden: self.draft_logits(hidden[None], requests)[0]

    def _suppressed(self, params: SamplingParams) -> list[int]:
        return sorted(self.target.eos_token_ids) if params.min_tokens else []

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        if params.is_greedy:
            return int(logits.argmax().item())
        return sample(probabilities(logits[None], params)[0], generator)

    def _commit(self, seq: Sequence, new_tokens: list[int], accepted_length: int | None,
                drafted: bool = True) -> RequestOutput:
        """Append this round's tokens, cut at a stop token or max_tokens, and report them. The acceptance histogram
        (ddtree_acceptance_length) counts drafting rounds only: an `ar` step or a tree of its root alone (drafted False)
        commits its one token by definition, and published it was one Triton IPC call per request and step (~13,000 a second at c=32)."""
        request = seq.request
        kept = new_tokens[: seq.max_tokens - request.num_output_tokens]
        for i, token in enumerate(kept):
            if token in seq.stop_ids:
                kept = kept[: i + 1]
                request.finish_reason = "stop"
                break
        request.output_ids.extend(kept)
        if request.finish_reason is None and request.num_output_tokens >= seq.max_tokens:
            request.finish_reason = "length"
        if accepted_length is not None:
            request.add_round(accepted_length)
            self.stage_times.rounds += 1
            if drafted:
                hist = self.stage_times.acceptance_histogram
                hist[accepted_length] = hist.get(accepted_length, 0) + 1
        return RequestOutput(
            request_id=request.request_id, new_token_ids=kept, finish_reason=request.finish_reason,
            num_input_tokens=len(request.prompt_ids), num_output_tokens=request.num_output_tokens,
            num_rounds=len(request.acceptance_lengths), mean_acceptance_length=request.mean_acceptance_length,
        )

    def _to_host(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """values copied to pinned host memory behind an event, not waited for (read with _read_host); off CUDA the
        values themselves, no event."""
        if self.device.type != "cuda":
            return values, None
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Around a round's device-to-host read: wait_gate open while this thread waits on the device (the read
        releases the GIL), closed when it goes back to host work."""
        gate = self.wait_gate
        if gate is None:
            yield
            return
        gate.set()
        try:
            yield
        finally:
            gate.clear()

    # -- single-request use (tests, benchmarks) --------------------------------------
    def generate(self, request: Request) -> Iterator[RequestOutput]:
        """Yield one RequestOutput per round of this request; it is the engine's only request."""
        self.add(request)
        while request.finish_reason is None:
            for output in self.step():
                if output.request_id == request.request_id:
                    yield output

    def warm_up(self) -> None:
        """Compile and capture the static forwards before serving (CUDA): a short greedy request in each mode this
        deployment serves (the batch-1 programs), and the target's one-token step of every padded batch size up to
        max_num_seqs and of a lone request in every slot (what plain decoding, and `auto` on `ar`, run under
        concurrency; vLLM captures its decode graphs for a list of batch sizes the same way), at every key bucket.
        Their first calls compile the fused chains and capture the graphs, seconds to tens of seconds that would
        otherwise land on the first users' requests; the trees of several requests are made on first use
        (GraphPool.late_keys, ddtree_static_programs_late_total). Counters and seeds are reset after."""
        if self.static_target is None:   # dynamic forwards (the CPU default) have nothing to prepare
            return
        t0 = time.perf_counter()
        budgets = [min(b, self.config.max_tree_budget) for b in (16, 64)]
        modes = [("ar", 1)] + ([("dflash", 1)] + [("ddtree", b) for b in budgets] if self.drafter is not None else [])
        # one prompt per key bucket (attention over 256, 512, ... cache positions), up to WARM_UP_MAX_KEYS
        lengths, keys = [16], 2 * MIN_KEYS
        while keys <= min(WARM_UP_MAX_KEYS, 2 * self.config.max_model_len) and keys // 2 + 1 < self.config.max_model_len - 8:
            lengths.append(keys // 2 + 1)
            keys *= 2
        starts = [n + 4 for n in lengths]
        for n in tqdm(lengths, desc="warm-up (compile, capture)", disable=None):
            prompt = [1 + i % (self.target.config.vocab_size - 1) for i in range(n)]
            for mode, budget in dict.fromkeys(modes):
                self.generate_ids(prompt, SamplingParams(mode=mode, tree_budget=budget, max_tokens=4, ignore_eos=True),
                                  request_id="warm-up")
            self._warm_shapes(n + 4, max(budgets) + 1 if self.drafter is not None else 1)
            self._warm_batched_steps(n + 4)
            self._warm_batched_drafts(n + 4)
        self._warm_device_trees(lengths[0] + 4, max(budgets) + 1)
        self._warm_batched_verifies(starts)
        self._warm_prefills()
        self._events.settle()
        self.stage_times, self._num_requests, self._round_end = StageTimes(), 0, None
        self.graphs.warmed = True
        logger.info("warm-up: %d static programs ready in %.1f s", len(self.graphs.programs), time.perf_counter() - t0)

    def _batch_sizes(self) -> list[int]:
        """The request counts warm-up makes batched programs for: 2, 4, ... up to max_num_seqs (each padded to a power
        of two, the scratch slot filling the rest; the largest is max_num_seqs itself)."""
        sizes, reqs = [], 2
        while reqs // 2 < self.config.max_num_seqs:
            sizes.append(min(reqs, self.config.max_num_seqs))
            reqs *= 2
        return sizes

    @staticmethod
    def _warm_tree(start: int, rows: int, block: int) -> tuple[list[int], list[int]]:
        """(parents, positions) of a warm-up tree of `rows` rows from `start`: a chain of min(rows, block) rows (the
        drafter's depth), the other rows leaves under its first node."""
        depth = min(rows, block)
        parents = list(range(-1, depth - 1)) + [0] * (rows - depth)
        positions = [start + i for i in range(depth)] + [start + 1] * (rows - depth)
        return parents, positions

    @staticmethod
    def _drop_pending(caches: list) -> None:
        """Forget a warm-up forward's stash (a hybrid's: never committed)."""
        for cache in caches:
            if getattr(cache, "pending", None) is not None:
                cache.pending = None

    @torch.inference_mode()
    def _warm_batched_steps(self, start: int) -> None:
        """The target's one-token step at this key bucket of a lone request in every other slot than 0 (a lone
        request's program is made for its slot: the last request of a batch can hold any) and of 2, 4, ...
        max_num_seqs requests (padded to a power of two: the scratch slot fills the rest), in slots 0.. (their next
        requests' prefills replace what it writes)."""
        for cache in self.caches[1 : self.config.max_num_seqs]:
            self.static_target.batch([cache], [start], [[1]], [[start]], [[-1]])
        for n in self._batch_sizes():
            if self.static_target.batch(self.caches[:n], [start] * n, [[1]] * n, [[start]] * n, [[-1]] * n) is None:
                break

    @torch.inference_mode()
    def _warm_batched_drafts(self, start: int) -> None:
        """The drafter's pass at this key bucket of 2, 4, ... max_num_seqs requests (padded to a power of two) appending
        a round's most context rows (StaticDrafter.round_rows): the program every batch of that size drafts through
        after warm-up unless its own rows' was made (longer contexts are written by the dynamic pass first:
        StaticDrafter.batch). Small programs (the block's hidden states, the staged features): ~30 MB at 27B dims and
        32 requests. In slots 0.. whose drafter contexts their next requests' prefills rewrite."""
        if self.static_drafter is None:
            return
        rows, block = self.static_drafter.round_rows, self.drafter.block_size
        ids = [1] + [self.drafter.config.mask_token_id] * (block - 1)
        features = torch.zeros(rows, len(self.tap_layers) * self.target.config.hidden_size,
                               dtype=dtype_of(self.config.dtype), device=self.device)
        for n in self._batch_sizes():
            caches = self.draft_caches[:n]
            for cache in caches:
                cache.length = max(start - rows, 0)
            self.static_drafter.batch(caches, [features] * n, [ids] * n)
        for cache in self.draft_caches:
            cache.length = 0
        self._sync()

    @torch.inference_mode()
    def _warm_batched_verifies(self, starts: list[int]) -> None:
        """The target's verify of 2, 4, ... max_num_seqs requests' trees (padded to a power of two) at the row bucket
        of each drafting arm of config.auto_arms and at each of these key buckets, smallest first (requests x rows,
        then keys), while the next fits within config.static_batch_memory MiB (_MemoryBudget; each holds its rows'
        logits and, for a hybrid, its stash). In slots 0.. whose contents their next requests' prefills replace."""
        if self.drafter is None or self.config.max_num_seqs < 2:
            return
        block = self.drafter.block_size
        rows = sorted({row_bucket(block) if arm.mode == "dflash" else row_bucket(arm.budget + 1)
                       for arm in parse_arms(self.config.auto_arms)
                       if arm.mode == "dflash" or (arm.mode == "ddtree" and arm.budget <= self.config.max_tree_budget)})
        shapes = sorted(((n, r, start) for n in self._batch_sizes() for r in rows for start in starts
                         if batch_bucket(n) * r <= StaticTarget.MAX_ROWS), key=lambda s: (batch_bucket(s[0]) * s[1], s[2]))
        budget, made = _MemoryBudget(self.config.static_batch_memory), 0
        for n, r, start in shapes:
            padded = batch_bucket(n) * r
            if not budget.fits(padded):
                break
            parents, positions = self._warm_tree(start, r, block)
            caches, before = self.caches[:n], self._allocated_bytes()
            if self.static_target.batch(caches, [start] * n, [[1] * r] * n, [positions] * n, [parents] * n) is not None:
                made += 1
            budget.add(self._allocated_bytes() - before, padded)
            self._drop_pending(caches)
        logger.info("warm-up: %d verifies of several requests' trees (of %d shapes), holding %.0f MiB", made, len(shapes),
                    budget.held / 2**20)

    @torch.inference_mode()
    def _warm_prefills(self) -> None:
        """The static prefills' programs (_prefill_static) up to self.static_prefill tokens: a lone prompt's of every
        row bucket, then those of 2, 4, ... max_num_seqs prompts together (padded to a power of two) of every
        prefill_bucket, smallest first, while the next group program fits within config.static_prefill_memory MiB
        (_MemoryBudget; each holds its outputs: ~2.5 MiB a row at 27B, prefill_probe_h200_27b_group8*.md); later
        groups of a row bucket are split into the largest made there (_static_groups). In slots 0.. whose contents
        their next requests' prefills replace (a hybrid's recurrent state is reset by each)."""
        lengths = range(1, self.static_prefill + 1)
        for rows in sorted({row_bucket(n) for n in lengths}):
            self._warm_prefill(1, rows)
        groups = []
        for rows in sorted({prefill_bucket(n) for n in lengths}):
            groups += [(n, rows) for n in self._batch_sizes() if batch_bucket(n) * rows <= StaticTarget.MAX_ROWS]
        self._group_sizes, budget = {}, _MemoryBudget(self.config.static_prefill_memory)
        for reqs, rows in sorted(groups, key=lambda shape: (shape[0] * shape[1], shape[1])):
            padded = batch_bucket(reqs) * rows
            if not budget.fits(padded):
                break
            before = self._allocated_bytes()
            if self._warm_prefill(reqs, rows):
                self._group_sizes[rows] = max(reqs, self._group_sizes.get(rows, 1))
                budget.add(self._allocated_bytes() - before, padded)
        logger.info("warm-up: static prefills of prompts admitted together up to %s (prompts by rows), holding %.0f MiB",
                    self._group_sizes, budget.held / 2**20)

    def _warm_prefill(self, reqs: int, rows: int) -> bool:
        """One static prefill program of reqs prompts of `rows` tokens made (False: no static shape fits)."""
        caches, chain = self.caches[:reqs], list(range(rows))
        if self.static_target.batch(caches, [0] * reqs, [[1] * rows] * reqs, [chain] * reqs,
                                    [[i - 1 for i in chain]] * reqs, prefill=True) is None:
            return False
        self._drop_pending(caches)
        return True

    def _allocated_bytes(self) -> int:
        """The device memory tensors hold now (CUDA; elsewhere 0: the static forwards run eagerly, holding nothing)."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    @torch.inference_mode()
    def _warm_device_trees(self, start: int, max_rows: int) -> None:
        """The tree builds on the device (StaticTreeBuild) of a full-depth draft at every row bucket up to max_rows,
        each in the paths form its bucket's verify takes (the verifies themselves are _warm_shapes')."""
        if self.static_tree is None:
            return
        depth = self.drafter.block_size - 1
        weight = self.target.lm_head.weight   # the drafter's outputs are in the target's hidden space
        hidden = torch.zeros(depth, weight.shape[1], dtype=weight.dtype, device=self.device)
        head = lambda h: Engine.draft_logits(self, h[None], [])[0]   # noqa: E731 (the engine's own, whatever a subclass drafts)
        for rows in sorted({row_bucket(n) for n in range(2, max_rows + 1)}):
            shape = self.static_target.device_tree_shape(self.caches[0], start, rows)
            if shape is not None:
                k = min(rows - 1, self.draft_vocab.width)
                self.static_tree(hidden, head, k, rows - 1, depth, 1, start, *shape)

    @torch.inference_mode()
    def _warm_shapes(self, start: int, max_rows: int) -> None:
        """The batch-1 programs at this key bucket that the short warm-up requests do not reach (they would capture on
        a user's request, and in a benchmark's measured rounds): the target's verify at every row bucket up to
        max_rows (a dflash block's chain, the smaller trees of a request's last rounds), on trees of the drafter's
        depth, and the drafter's pass after every context-row bucket up to block + 1 (a round's accepted tokens) and
        for a first draft after a prompt of this key bucket (the prompt's features, all at once); a hybrid target's
        commit of every path bucket after each of those verifies. They run on slot 0,
        whose contents the next request's prefill replaces (what they commit is overwritten)."""
        block = self.drafter.block_size if self.drafter is not None else 1
        for rows in sorted({row_bucket(n) for n in range(1, max_rows + 1)}):
            depth = min(rows, block)
            parents, positions = self._warm_tree(start, rows, block)
            cache = self.caches[0]

            def verify():
                return self.static_target.batch([cache], [start], [[1] * rows], [positions], [parents])

            if verify() is None:
                break   # no static shape fits (the dynamic forward would run): larger trees fit none either
            if getattr(cache, "pending", None) and cache.pending is not getattr(cache, "static_stash", None):
                verify()   # a first call runs eagerly, then captures: a replay's stash is the program's (commits statically)
            stash = getattr(cache, "pending", None)    # a hybrid target's: its commit of every path bucket
            for n in sorted({min(path_bucket(n), depth) for n in range(1, depth + 1)} if stash else ()):
                cache.pending = stash
                self.static_commit(cache, start, list(range(n)))
            if stash is not None:
                cache.pending = None
        if self.static_drafter is None:
            return
        cache, ids = self.draft_caches[0], [1] + [self.drafter.config.mask_token_id] * (block - 1)
        max_len = cache.pool.k.shape[2]
        keys = key_bucket(start, max_len)
        # the prompts whose first draft (all their features at once) has these keys
        lengths = [n for n in range(1, keys + 1) if key_bucket(n, max_len) == keys] if keys else []
        rounds = [(max(start - rows, 0), rows) for rows in sorted({row_bucket(m) for m in range(1, block + 2)})]
        prompts = [(0, rows) for rows in sorted({row_bucket(n) for n in lengths}) if rows <= StaticDrafter.MAX_ROWS]
        features = torch.zeros(max(rows for _, rows in rounds + prompts), len(self.tap_layers) * self.target.config.hidden_size,
                               dtype=dtype_of(self.config.dtype), device=self.device)
        for length, rows in rounds + prompts:
            cache.length = length
            self.static_drafter.batch([cache], [features[:rows]], [ids])
        cache.length = 0
        self._sync()

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "local") -> Request:
        """Run a request to completion in process."""
        request = Request(request_id=request_id, prompt_ids=list(prompt_ids), params=params)
        for _ in self.generate(request):
            pass
        return request
