"""EngineConfig: every engine knob, built once from the deployment's parameters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ddtree.budget import DEFAULT_ARMS, parse_arms

MODES = ("ar", "dflash", "ddtree", "auto")   # auto: ddtree with per-round budgets from ddtree.budget
DTYPES = ("float32", "bfloat16", "float16")


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


MAX_STREAM_INTERVAL = 1024
STATIC_PREFILL_AUTO = 256   # static_prefill's "auto" where static forwards are CUDA graphs (its row buckets up to 256)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    target_path: str
    drafter_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    default_mode: str = "ddtree"
    default_tree_budget: int = 16
    max_tree_budget: int = 1024
    max_model_len: int = 2048          # prompt + generated tokens per request
    max_tokens_limit: int = 2048       # upper bound a request may ask for
    default_max_tokens: int = 256
    # a streamed request gets a response every this many rounds (its first text and its end at once): fewer
    # responses, less per-round serving work (vLLM's and TensorRT-LLM's stream_interval); 1 = every round
    default_stream_interval: int = 1
    # streamed responses a second, all streams together, above which a stream's rounds travel in fewer responses
    # (each stream then gets one at most every active streams / this seconds; its first text and its end at once):
    # Triton's postprocessing step runs one Python execution per streamed response (~0.3-0.65 ms each), so one
    # instance caps an ensemble's tokens/s at ~1,500-3,000 responses a second when every round is sent; 0 = no limit
    stream_response_rate: int = 0
    max_num_seqs: int = 1              # requests decoded together (one cache slot each)
    max_queue_size: int = 256          # requests waiting for a slot; beyond it: an overload error
    cost_model_path: str | None = None   # verify-cost data for mode "auto" (default: ddtree/data/cost_model_{cpu,h200}.json by device)
    # what mode "auto" measures and picks from each round (ddtree.budget.ArmSelector)
    auto_arms: str = DEFAULT_ARMS
    num_threads: int = 0               # torch CPU threads; 0 keeps torch's default
    # drafter passes and target verifies as static forwards (ddtree.models.graphs): "auto" = on CUDA, captured as
    # CUDA graphs; "on" = also elsewhere (run eagerly: how the CPU tests check it); "off" = the dynamic forward
    static_forward: str = "auto"
    cuda_graphs: bool = True           # capture static forwards as CUDA graphs (off: run them eagerly)
    # with static forwards, a lone greedy request's draft tree is built on the device between its draft and its
    # verify (one device-to-host read per round); off: read the draft's top-k and build the tree on the host. None
    # ("auto"): on where the static forwards are CUDA graphs on CUDA (on the H200 its rounds against their own `ar`:
    # ddtree-16 1.355, ddtree-64 1.568 against the host build's 1.403 / 1.641: perf/results/gpu_ratios_h200_treeturns.md), off elsewhere
    device_tree: bool | None = None
    # greedy `ar` requests' next step queued before this one's tokens are read (their input ids copied on the
    # device from this step's argmax), so the device never waits for the host between steps; settled as a round when
    # the batch changes. None ("auto"): on where the static forwards are CUDA graphs on CUDA (27B on the H200: an `ar`
    # round 13.15 ms against 13.53-14.13, 1.08x the weight-streaming floor: perf/results/gpu_ratios_h200_arahead.md;
    # a batch's steps queued too: `ar` 1.20-1.54x the tokens/s at 2-32 requests of SmolLM2 shapes in process:
    # perf/results/round_profile_h200_lookahead_{true,auto}.md)
    ar_lookahead: bool | None = None
    # a lone greedy request's next draft launched as soon as its round's acceptance is known, before that round's cache
    # commit and bookkeeping (Engine._launch_draft_ahead): the device drafts while the host commits, reports and
    # starts the next round, instead of idling until the next round launches its draft; undone (the drafter's context
    # length and pending features put back) when the next round does not take it. Needs device_tree. None ("auto"):
    # as device_tree. Off by default: on an H100 (27B shape, 3 turns beside the default) its rounds were 0.992 / 0.990 /
    # 0.996x (dflash, ddtree-16, ddtree-64, median turn), one turn of each above 1.0 (perf/results/gpu_ratios_h100_ahead.md)
    draft_ahead: bool | None = False
    # the drafter proposes only token ids below this, and the EOS ids (0: the whole vocabulary): its logits read that
    # many rows of the target's lm_head instead of all (ddtree.draft_vocab; lossless whatever it is)
    draft_vocab: int = 0
    # a prompt of at most this many tokens is prefilled through a static forward, prompts admitted together through one
    # per row bucket (Engine._static_groups); a CUDA graph per row bucket (and group size) on CUDA, one for every slot,
    # made at warm-up: an eager prefill makes ~60 torch calls a layer, host-bound at small models; a hybrid's slot state
    # reset first, its GDN layers on the masked form; 0: off. None ("auto"):
    # STATIC_PREFILL_AUTO where the static forwards are CUDA graphs on CUDA, else off (the embedded default on the
    # H200: time to first token 2.2 ms against 25 in process, `ar` 1109 tok/s against 898:
    # perf/results/humaneval_h200_sprefill.md beside humaneval_h200_default.md; a 27B-shaped hybrid's 16-256-token
    # prompts 22-54 ms against 139-171, its programs holding 3.4 GB: prefill_probe_h200_27b.md)
    static_prefill: int | None = None
    # MiB of device memory the static prefills of prompts admitted together may hold: warm-up makes their programs
    # (2, 4, ... prompts of each row bucket), smallest first, while the next fits by the bytes a row of those before
    # it; larger groups split into the largest made (a 27B hybrid's hold ~2.5 MiB a row: with the lone prompts'
    # programs, groups of up to 8 prompts of up to 128 rows held 13,095 MiB with every program, 6,353 MiB within 256
    # rows a program; prefill_probe_h200_27b_group8*.md; the lone prompts' programs are outside this budget).
    # 0: prompts admitted together take a lone static prefill each
    static_prefill_memory: int = 2048
    # MiB of device memory the verifies of several requests' trees may hold as programs made at warm-up (2, 4, ...
    # max_num_seqs requests, the row bucket of each drafting arm of `auto_arms`: a dflash block, a ddtree-b tree's
    # b + 1 rows; smallest first, every key bucket, while the next fits): what `auto`'s probes and concurrent
    # drafting requests verify through. A shape not made is made on first use, on requests' time (60-70 ms a capture
    # at SmolLM2 dims on the H200, against 1.5 ms an `ar` round at 16 streams: concurrency_h200_split.md). 0: none
    # made at warm-up
    static_batch_memory: int = 2048
    # the Triton model runs the engine and its GenerationService in a child process of its own (ddtree.engine_process),
    # started with a plain Python interpreter of the same version, instead of on a thread of the Python backend's stub:
    # the stub embeds the shared libpython (the probe's pure-Python loop 1.2-1.5x slower there than in process) and
    # its request parsing, sends and metrics share the GIL with the engine thread; the child's responses cross a pipe to
    # the stub, which sends them on. None ("auto"): on where the device is CUDA (on an H100 Triton / in process 0.92 /
    # 0.85 / 0.90 / 0.92 for ar / dflash / ddtree-16 / ddtree-64 against 0.77 / 0.83 / 0.82 / 0.86 on the thread:
    # perf/results/humaneval_h100_{process,thread}.md), off elsewhere (the 2-core CPU's compute-bound rounds gain
    # nothing: perf/results/concurrency_cpu_engine_process_*.md). Only the Triton model reads it
    engine_process: bool | None = None
    seed: int = 0                      # seed for requests that give none
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default_mode not in MODES:
            raise ValueError(f"default_mode must be one of {MODES}, got {self.default_mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 1 <= self.max_tree_budget <= 4096:
            raise ValueError(f"max_tree_budget must be in [1, 4096], got {self.max_tree_budget}")
        if not 1 <= self.default_tree_budget <= self.max_tree_budget:
            raise ValueError(
                f"default_tree_budget must be in [1, {self.max_tree_budget}], got {self.default_tree_budget}"
            )
        if self.default_mode != "ar" and not self.drafter_path:
            raise ValueError(f"default_mode {self.default_mode!r} needs drafter_path")
        if self.static_forward not in ("auto", "on", "off"):
            raise ValueError(f"static_forward must be auto, on or off, got {self.static_forward!r}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        if not 1 <= self.max_num_seqs <= 1024:
            raise ValueError(f"max_num_seqs must be in [1, 1024], got {self.max_num_seqs}")
        if not 1 <= self.default_stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"default_stream_interval must be in [1, {MAX_STREAM_INTERVAL}], "
                             f"got {self.default_stream_interval}")
        if self.stream_response_rate < 0:
            raise ValueError(f"stream_response_rate must be >= 0 (0: no limit), got {self.stream_response_rate}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        if self.static_prefill is not None and self.static_prefill < 0:
            raise ValueError(f"static_prefill must be >= 0, got {self.static_prefill}")
        if self.static_prefill_memory < 0:
            raise ValueError(f"static_prefill_memory must be >= 0 (MiB), got {self.static_prefill_memory}")
        if self.static_batch_memory < 0:
            raise ValueError(f"static_batch_memory must be >= 0 (MiB), got {self.static_batch_memory}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        parse_arms(self.auto_arms)   # raises ValueError on an unknown arm

    @classmethod
    def from_dict(cls, values: dict[str, Any], base_dir: str | Path | None = None) -> "EngineConfig":
        """Build from string-valued parameters (Triton config.pbtxt); unknown keys are an error."""
        known = {f.name: f for f in fields(cls) if f.name != "extra"}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {unknown}; known: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            if raw is None or (isinstance(raw, str) and raw.strip() == ""):
                continue
            kind = known[name].type
            if "None" in str(kind) and str(raw).strip().lower() == "auto" and "str" not in str(kind):
                kwargs[name] = None
            elif "int" in str(kind) and "str" not in str(kind):
                kwargs[name] = int(raw)
            elif "bool" in str(kind):
                kwargs[name] = _as_bool(raw)
            else:
                kwargs[name] = str(raw)
        for key in ("target_path", "drafter_path", "cost_model_path"):
            if kwargs.get(key) and base_dir is not None and not Path(kwargs[key]).is_absolute():
                kwargs[key] = str((Path(base_dir) / kwargs[key]).resolve())
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
