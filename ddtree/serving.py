"""GenerationService: the engine behind a queue and a worker thread, streaming to response sinks.

Triton-agnostic: the generation model wraps Triton's response sender in a ResponseSink, and
tests can use any object with the same three methods.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from ddtree import api
from ddtree.cancellation import CANCEL_CHECK_S, cancel_check_interval
from ddtree.detokenize import IncrementalDetokenizer, StreamChunk
from ddtree.engine import Engine
from ddtree.errors import EngineUnavailable, InvalidRequest
from ddtree.profiling import CProfileWindows, StepProfiler, name_native_thread
from ddtree.request import Request, RequestOutput
from ddtree.stop_registry import StopRegistry

logger = logging.getLogger(__name__)


class ResponseSink(Protocol):
    def is_cancelled(self) -> bool: ...
    def send(self, outputs: dict[str, Any], final: bool) -> None: ...
    def send_error(self, message: str, kind: str, final: bool = True) -> None: ...   # kind: invalid|cancelled|internal|unavailable


@dataclass(slots=True)
class Job:
    request_id: str
    request: api.GenerateRequest
    sink: ResponseSink
    arrival_s: float
    key: str
    is_stopped: bool = False    # set by stop(key): a cancellation that reached us by another route
    send_failed: bool = False   # set by the outbox when a response could not be sent: the request is dropped
    checked_s: float = 0.0      # when the client's cancellation was last asked (time.monotonic)
    check_queued: bool = False  # a cancellation check is waiting in the outbox
    engine_request: Request | None = None
    stream: "_Stream | None" = None
    text_on_outbox: bool = False  # its responses are built on the outbox (no stop strings: its end never waits on text)
    first_token: bool = False   # its first token was generated (time to first token observed)
    taken_s: float = 0.0        # when the engine thread took it from the queue (_start; time.perf_counter)


@dataclass(slots=True)
class ServiceStats:
    num_active: int = 0
    num_waiting: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_rejected_overload: int = 0
    num_output_tokens: int = 0
    num_responses: int = 0           # responses with outputs sent to clients (streamed deltas and finals, not errors)
    #                                  counted on the outbox thread, as the fields it alone writes below (OUTBOX_FIELDS)
    num_rounds: int = 0              # decoding rounds, summed over requests
    num_batch_rounds: int = 0        # decoding rounds of the whole batch (engine steps that decode)
    num_held_slots: int = 0          # cache slots in use (0 when idle: nothing leaks)
    num_tree_nodes: int = 0
    draft_seconds: float = 0.0
    draft_gpu_seconds: float = 0.0   # CUDA: the drafts' GPU timeline (draft_seconds - this: the wait for the last
    #                                  round's commit on the device, which the draft's read is queued behind)
    verify_seconds: float = 0.0
    verify_gpu_seconds: float = 0.0  # CUDA: the verifies' GPU timeline (verify_seconds - this: host wake-up after them)
    host_seconds: float = 0.0        # decoding round time outside the drafter and target passes
    serve_seconds: float = 0.0       # engine-thread time outside engine steps: streaming, cancellation checks, metrics
    acceptance_histogram: dict[int, int] = field(default_factory=dict)   # tokens committed in a drafting round -> rounds
    auto_arm_rounds: dict[str, int] = field(default_factory=dict)        # mode auto: batch rounds per arm it ran
    auto_arm_seconds: dict[str, float] = field(default_factory=dict)     # mode auto: time charged to each arm's rounds
    num_late_programs: int = 0       # static programs made while serving (shapes warm-up did not prepare: each one
    #                                  compiled, and on CUDA captured, on a request's time)
    engine_healthy: int = 1          # 0 after a fatal engine error: the instance answers UNAVAILABLE from then on
    num_slow_steps: int = 0          # engine steps over StallWatch.FACTOR x the recent steps' mean (stalls)
    slow_step_seconds: float = 0.0   # their time
    gc_seconds: float = 0.0          # this process's garbage collections (any thread's), since the service started
    num_full_gcs: int = 0            # of which full collections (they walk every object not frozen: freeze_heap)
    num_dynamic_forwards: int = 0    # drafter passes and verifies no static program fitted while static forwards are on
    # the sender's time (the outbox thread's here; EngineProcess puts its relay thread's in their place): responses and
    # errors handed to the sinks, and the clients' cancellation asked (a Triton IPC round trip each)
    send_seconds: float = 0.0
    cancel_check_seconds: float = 0.0
    num_cancel_checks: int = 0
    # the metrics' own cost: seconds the model's process spent publishing them (Triton IPC calls, on
    # engine_process.MetricsPublisher's thread, which sets these two), and how many updates
    metrics_publish_seconds: float = 0.0
    num_metrics_publishes: int = 0
    # seconds from a request's arrival at the model to its first generated token, and to its last (finished
    # requests), observed since the last publication: each published once (only while stats are published)
    ttft_seconds: list[float] = field(default_factory=list)
    latency_seconds: list[float] = field(default_factory=list)
    # of each time to first token: from the arrival to the start of the step's prefill that admitted the request (the
    # engine's queue, a full batch, the step in progress), and that prefill (all the requests that step admitted)
    queue_seconds: list[float] = field(default_factory=list)
    prefill_seconds: list[float] = field(default_factory=list)
    # of each queue time: from the arrival to the engine thread taking the request (the step in progress when it came)
    take_seconds: list[float] = field(default_factory=list)


class StallWatch:
    """Engine steps far slower than the recent ones: a stall of every stream (a full garbage collection, a compile or
    capture of a program warm-up did not make, a first-time cost) among steps of a few milliseconds, which the mean
    stage times hide. Each is counted, and logged (at most every LOG_EVERY_S) with what was running and what ran in
    it. Also the process's garbage collections, whichever thread's allocation set them off (gc.callbacks)."""

    FACTOR = 10.0       # a step over this many times the recent steps' mean (an exponential mean over ~20 steps) ...
    MIN_S = 0.05        # ... and over this is a stall (a CPU engine's steps take 10-1000 ms: only the outliers)
    LOG_EVERY_S = 10.0

    def __init__(self) -> None:
        self.mean: float | None = None
        self.gc_seconds, self.full_gcs = 0.0, 0
        self._gc_start = 0.0
        self._logged = float("-inf")
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_start
            self.full_gcs += info["generation"] == 2

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def before(self) -> tuple[float, int]:
        return self.gc_seconds, self.full_gcs

    def is_stall(self, seconds: float) -> bool:
        """Whether a step of this many seconds stalls; otherwise it joins the recent steps' mean."""
        if self.mean is not None and seconds > max(self.FACTOR * self.mean, self.MIN_S):
            return True
        self.mean = seconds if self.mean is None else 0.95 * self.mean + 0.05 * seconds
        return False

    def log(self, seconds: float, before: tuple[float, int], what: str) -> None:
        now = time.monotonic()
        if now - self._logged < self.LOG_EVERY_S:
            return
        self._logged = now
        logger.warning("engine step stalled: %.0f ms against %.1f ms a step recently (%s; garbage collection in it "
                       "%.0f ms, %d full)", 1e3 * seconds, 1e3 * (self.mean or 0.0), what,
                       1e3 * (self.gc_seconds - before[0]), self.full_gcs - before[1])


METRICS_INTERVAL_S = 0.1   # the most often metrics are published while the engine works
# ServiceStats fields only the outbox thread writes: a published snapshot takes them when the outbox publishes it, after
# the calls queued before it (the engine thread's snapshot would miss the responses it has not sent yet)
OUTBOX_FIELDS = ("num_responses", "send_seconds", "cancel_check_seconds", "num_cancel_checks")
# The longest the outbox holds a call back for the engine thread's next wait on the device (Outbox's gate), counted
# from when the call was queued: a round that never waits (a CPU engine's reads return at once, host-bound rounds
# whose device work is done before they read it) or an idle spell does not hold responses longer than this, and calls
# queued behind others that waited go at once (a wait per call capped the outbox at 1 / GATE_WAIT_S calls a second).
GATE_WAIT_S = 0.002


# Errors after which the engine's device state cannot be trusted: the instance stops serving.
FATAL_MARKERS = ("CUDA error", "CUDA out of memory", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error",
                 "device-side assert", "NCCL error", "illegal memory access", "out of memory", "can't allocate memory")


def is_fatal(error: BaseException) -> bool:
    """A CUDA / out-of-memory error (sticky on the device), or anything that is not an ordinary Exception."""
    if not isinstance(error, Exception) or isinstance(error, MemoryError):
        return True
    return any(marker in str(error) for marker in FATAL_MARKERS)


def freeze_heap() -> int:
    """Once the engine is loaded and warmed up: collect, then move every object alive into the collector's permanent
    generation (gc.freeze, as vLLM does after capturing its graphs). What loading and warm-up leave is ~300k objects
    (torch, transformers, the models' modules), and a full collection walks all of them: ~100 ms on the 2-core CPU
    machine with the embedded default loaded (perf/gc_probe.py, perf/results/gc_probe_cpu.md), a stall of every
    stream whenever Python decides on one (rarely: a batch of 16 requests made one young collection).
    Frozen, they are never walked again; objects freed by their reference counts are freed as before. Returns how
    many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("gc: %d objects from loading and warm-up frozen (full collections no longer walk them)", frozen)
    return frozen


def parse_fault_injection(spec: str) -> int | None:
    """TEST ONLY (deployment parameter ``fault_injection``, off by default): "fatal_after_rounds:N" makes the
    engine thread raise a simulated CUDA error after N batch rounds. Returns N, or None when off."""
    if not spec:
        return None
    kind, _, value = spec.partition(":")
    if kind != "fatal_after_rounds" or not value.isdigit():
        raise ValueError(f"fault_injection must be 'fatal_after_rounds:N', got {spec!r}")
    return int(value)


class Outbox:
    """Calls made in order on a thread of their own: the engine thread's responses and metrics. A Triton send or
    metric update is an IPC round trip (~0.7 ms per response measured on the CPU); queued here, it overlaps the
    engine's next round instead of delaying it. FIFO, so each request's responses keep their order and its final
    response (or error) comes last.

    inline (DDTREE_INLINE_SENDS=1, a diagnostic): every call made at once on the caller's thread (the engine's), no
    second thread holding the GIL when the engine thread wakes from its GPU waits. Measuring the engine's stage
    times both ways through Triton (perf/humaneval.py's stage table) tells whether that contention is what makes
    the stages slower inside the Python backend's stub than in process.

    gate (a threading.Event; Engine.wait_gate): each call waits for it (until GATE_WAIT_S after it was queued), so the
    outbox's Python work (building a response, its tensors, the metrics) runs while the engine thread waits on the
    device, not while it prepares and launches a round. Every torch call releases the GIL, so a second thread that
    wants it gets it at each of the engine thread's launches and holds it for its own Python; on the H200 through
    Triton the stub's draft stage took 0.65-0.70 ms of host time a round against 0.28-0.41 in process
    (humaneval_h200_treeprog).

    defer (with a gate; the GenerationService's default, DDTREE_OUTBOX_WAKE=put turns it off): the owner thread's (the
    engine's) calls are held in a list and handed over when the gate opens (DeviceWaitGate.on_open: the engine's next
    device wait, or its idle wait), one wake-up of the outbox thread a round; otherwise every put wakes it, and the
    thread takes the GIL at the engine thread's next launch only to find the gate closed and wait again. Calls from
    other threads go at once."""

    def __init__(self, inline: bool = False, gate: threading.Event | None = None, defer: bool = False) -> None:
        self.inline = inline
        self.gate = gate
        self.defer = defer and gate is not None and not inline
        self.owner: int | None = None     # the thread whose calls are deferred (the engine thread, once it runs)
        self._pending: collections.deque = collections.deque()
        self._closing = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ddtree-outbox", daemon=True)
        if not inline:
            self._thread.start()

    def put(self, call, *args) -> None:
        if self.inline:
            self._call(call, args)
        elif self.defer and threading.get_ident() == self.owner:
            self._pending.append((time.monotonic(), call, args))
        else:
            self._queue.put((time.monotonic(), call, args))

    def flush(self) -> None:
        """The deferred calls to the outbox thread, in order, with one wake-up."""
        batch = []
        try:
            while True:
                batch.append(self._pending.popleft())
        except IndexError:
            pass
        if batch:
            self._queue.put(batch)

    def flush_late(self) -> None:
        """Once a loop: deferred calls that have waited GATE_WAIT_S for a device wait go anyway (steps that never wait)."""
        if self._pending and time.monotonic() - self._pending[0][0] > GATE_WAIT_S:
            self.flush()

    @staticmethod
    def _call(call, args) -> None:
        try:
            call(*args)
        except Exception:   # each call handles its own failures; this keeps the outbox alive regardless
            logger.exception("outbox call %s failed", getattr(call, "__name__", call))

    def _run(self) -> None:
        name_native_thread("ddtree-outbox")
        while (item := self._queue.get()) is not None:
            for queued_s, call, args in item if isinstance(item, list) else (item,):
                if self.gate is not None and not self._closing:
                    wait_s = queued_s + GATE_WAIT_S - time.monotonic()
                    if wait_s > 0:
                        self.gate.wait(wait_s)
                self._call(call, args)

    def close(self, timeout_s: float) -> None:
        """Send what is queued (without waiting for the gate), then stop."""
        if not self.inline:
            self.flush()
            self._closing = True
            self._queue.put(None)
            self._thread.join(timeout_s)


class DeviceWaitGate(threading.Event):
    """Open while the engine thread waits on the device (Engine.wait_gate) or for requests; opening it first calls
    on_open (the outbox's flush)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_open = None

    def set(self) -> None:
        if self.on_open is not None:
            self.on_open()
        super().set()


class GenerationService:
    """Runs the engine on its own thread: each step admits new jobs and advances every running one."""

    def __init__(self, engine: Engine, tokenizer, on_stats=None, max_queue_size: int = 256,
                 fault_injection: str = "", stop_registry: StopRegistry | None = None) -> None:
        self.engine = engine
        self.stop_registry = stop_registry  # stops routed to another instance of the model arrive here
        self._relays_checked_s = float("-inf")
        self.tokenizer = tokenizer
        self.stats = ServiceStats()
        self.on_stats = on_stats          # called with a stats snapshot after they change (metrics), from the outbox
        self._last_published = 0.0        # when on_stats last ran
        self._step_seconds = 0.0          # the last engine step's wall time
        self.max_queue_size = max_queue_size
        self._response_rate = engine.config.stream_response_rate   # streamed responses a second at most (0: any)
        self.fatal_error: str | None = None     # set once, by the first fatal engine error; never cleared
        self._fault_after_rounds = parse_fault_injection(fault_injection)
        if self._fault_after_rounds is not None:
            logger.warning("TEST ONLY: fault_injection=%r: a simulated CUDA error after %d batch rounds",
                           fault_injection, self._fault_after_rounds)
        self._lock = threading.Lock()
        self._num_queued = 0
        self._by_key: dict[str, Job] = {}
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._active: dict[str, Job] = {}   # engine request id (= job key) -> job
        self._stopping = False
        self._profiler = StepProfiler()   # DDTREE_PROFILE (a diagnostic): off by default
        self._cprofiler = CProfileWindows(describe=self._running_modes)   # DDTREE_CPROFILE (a diagnostic): off by default
        self._stalls = StallWatch()
        # the outbox's calls wait for the engine thread's device waits: a CUDA engine's by default; DDTREE_OUTBOX_GATE=0
        # (a diagnostic) turns that off, =1 on whatever the device
        gate = os.environ.get("DDTREE_OUTBOX_GATE", "")
        gated = gate == "1" or (gate != "0" and getattr(getattr(engine, "device", None), "type", None) == "cuda")
        self._gate = DeviceWaitGate() if gated else None
        interval = os.environ.get("DDTREE_SWITCH_INTERVAL_MS", "")   # a diagnostic: how long a thread may keep the GIL
        if interval:
            sys.setswitchinterval(float(interval) / 1e3)
        engine.wait_gate = self._gate
        # where gated, the engine thread's outbox calls are handed over at its device waits (DDTREE_OUTBOX_WAKE=put, a
        # diagnostic: each put wakes the outbox), and a request without stop strings has its responses built on the
        # outbox, in those waits (DDTREE_OUTBOX_TEXT=0: on the engine thread; =1: on the outbox even ungated). On the
        # H100 through Triton, with the engine in its child process, the two together took the serving loop's own
        # time from ~0.065 to ~0.02 ms a round (perf/results/service_probe_h100_defer.md, humaneval_h100_outbox.md).
        # Running those calls on the engine thread itself while each device wait's work was still on the device
        # (tried 2026-12-06) made the child's drafting rounds slower, not faster: service_probe_h100_drain.md
        self._outbox = Outbox(inline=os.environ.get("DDTREE_INLINE_SENDS", "0") not in ("", "0"), gate=self._gate,
                              defer=os.environ.get("DDTREE_OUTBOX_WAKE", "round") != "put")
        if self._gate is not None:
            self._gate.on_open = self._outbox.flush
        text = os.environ.get("DDTREE_OUTBOX_TEXT", "")
        self._text_on_outbox = text not in ("", "0") or (text == "" and self._gate is not None)
        if on_stats is not None:
            on_stats(self.stats)            # gauges start at their values (engine_healthy 1) before any request
        self._worker = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
        self._worker.start()

    @property
    def is_healthy(self) -> bool:
        return self.fatal_error is None

    def submit(self, request_id: str, request: api.GenerateRequest, sink: ResponseSink,
               arrival_s: float | None = None) -> None:
        """Queue a request; answers at once with UNAVAILABLE when the queue is full or the engine has failed.
        arrival_s: when it arrived (time.perf_counter; another process's on Linux, where it is CLOCK_MONOTONIC)."""
        key = uuid.uuid4().hex
        job = Job(request_id, request, sink, time.perf_counter() if arrival_s is None else arrival_s, key)
        if self.fatal_error is None and not self._worker.is_alive() and not self._stopping:
            self._fail_fatal(EngineUnavailable("the engine thread is not running"), "engine thread died")
        with self._lock:   # the job is queued under the lock: _fail_fatal drains every job queued before it
            unavailable = self.fatal_error
            # waiting = not yet holding a cache slot: in our queue, or in the engine's
            overloaded = unavailable is None and self._num_queued + len(self.engine.waiting) >= self.max_queue_size
            if overloaded:
                self.stats.num_rejected_overload += 1
            elif unavailable is None:
                self._num_queued += 1
                self._by_key[key] = job
                self._jobs.put(job)
        if unavailable is not None:
            self.stats.num_failed += 1
            logger.warning("[%s] rejected: engine unavailable since a fatal error (%s)", request_id, unavailable)
            sink.send_error(f"model unavailable: the engine failed with a fatal error ({unavailable}); "
                            "this instance no longer serves, restart the server", "unavailable")
            self._report_safely()   # the engine thread has stopped: metrics move from here now
        elif overloaded:
            logger.warning("[%s] rejected: %d requests waiting (max_queue_size)", request_id, self.max_queue_size)
            sink.send_error(f"server overloaded: {self.max_queue_size} requests already waiting; retry later",
                            "unavailable")

    def stop(self, key: str) -> bool:
        """Stop the request with this key at its next round (Triton ensembles do not pass a
        client's cancellation to a running step; the postprocessing step relays it here)."""
        with self._lock:
            job = self._by_key.get(key)
        if job is not None:
            job.is_stopped = True
        elif self.stop_registry is not None:   # maybe another instance's: leave it a marker
            self.stop_registry.post(key)
        return job is not None

    def _claim_relayed_stops(self) -> None:
        """Stops relayed through the registry (a directory listing, a system call: in a sandboxed kernel tens of
        microseconds) are looked for at most every CANCEL_CHECK_S, as clients' cancellations are, not every round."""
        if self.stop_registry is None:
            return
        now = time.monotonic()
        if now - self._relays_checked_s < CANCEL_CHECK_S:
            return
        self._relays_checked_s = now
        with self._lock:
            keys = set(self._by_key)
        for key in self.stop_registry.claim(keys) if keys else ():
            with self._lock:
                job = self._by_key.get(key)
            if job is not None:
                logger.info("[%s] stop relayed from another instance", job.request_id)
                job.is_stopped = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._jobs.put(None)
        self._worker.join(timeout_s)
        self._outbox.close(timeout_s)
        self._stalls.close()

    def _report(self) -> None:
        engine, times = self.engine, self.engine.stage_times
        self.stats.num_waiting = self._num_queued + len(engine.waiting)
        self.stats.num_active = len(engine.running)
        self.stats.num_held_slots = engine.config.max_num_seqs - len(engine.free_slots)
        self.stats.num_rounds, self.stats.num_tree_nodes = times.rounds, times.tree_nodes
        self.stats.num_batch_rounds = times.batch_rounds
        self.stats.draft_seconds, self.stats.verify_seconds = times.draft, times.verify
        self.stats.verify_gpu_seconds, self.stats.draft_gpu_seconds = times.verify_gpu, times.draft_gpu
        self.stats.host_seconds = times.host
        # the engine's own dicts: copied once, into the snapshot below, when the stats are published
        self.stats.acceptance_histogram, self.stats.auto_arm_rounds = times.acceptance_histogram, times.auto_arm_rounds
        self.stats.auto_arm_seconds, self.stats.num_late_programs = times.auto_arm_seconds, len(engine.graphs.late_keys)
        self.stats.gc_seconds, self.stats.num_full_gcs = self._stalls.gc_seconds, self._stalls.full_gcs
        self.stats.num_dynamic_forwards = self.engine.stage_times.dynamic_forwards
        # publishing costs one IPC call per changed metric in Triton (several per round): at most every
        # METRICS_INTERVAL_S while the engine works, and always once it is idle (scrapes then see final values)
        now = time.monotonic()
        if self.on_stats is not None and (now - self._last_published >= METRICS_INTERVAL_S or not engine.has_work
                                          or self.fatal_error is not None):
            self._last_published = now
            # a snapshot: the engine thread goes on changing the stats while the outbox publishes them
            self._outbox.put(self._publish, dataclasses.replace(
                self.stats, acceptance_histogram=dict(self.stats.acceptance_histogram),
                auto_arm_rounds=dict(self.stats.auto_arm_rounds), auto_arm_seconds=dict(self.stats.auto_arm_seconds)))
            # the snapshot took them
            self.stats.ttft_seconds, self.stats.latency_seconds = [], []
            self.stats.queue_seconds, self.stats.prefill_seconds, self.stats.take_seconds = [], [], []

    def _publish(self, snapshot: ServiceStats) -> None:
        """On the outbox thread: the engine thread's snapshot, with the fields this thread writes as of now."""
        for name in OUTBOX_FIELDS:
            setattr(snapshot, name, getattr(self.stats, name))
        self.on_stats(snapshot)

    def _running_modes(self) -> list[str]:
        return [seq.request.params.mode for seq in getattr(self.engine, "running", [])]

    def _loop(self) -> None:
        name_native_thread("ddtree-engine")
        self._outbox.owner = threading.get_ident()
        try:
            while not self._stopping and self.fatal_error is None:
                idle = not self.engine.has_work
                if idle and self._gate is not None:
                    self._gate.set()     # waiting for requests: the outbox goes on at once
                self._take_jobs(block=idle)
                if idle and self._gate is not None:
                    self._gate.clear()
                if self.engine.has_work:
                    start = time.perf_counter()
                    self._claim_relayed_stops()
                    self._profiler.before_step()
                    self._cprofiler.before_step()
                    gc_before, late_before = self._stalls.before(), len(self.engine.graphs.late_keys)
                    dynamic_before = self.engine.stage_times.dynamic_forwards
                    self._step()
                    self._profiler.after_step()
                    self._cprofiler.after_step()
                    if self._stalls.is_stall(self._step_seconds):
                        self._stall(gc_before, late_before, dynamic_before)
                    self._report()
                    self._outbox.flush_late()
                    self.stats.serve_seconds += time.perf_counter() - start - self._step_seconds
                else:
                    self._report()
        except BaseException as e:  # the thread itself failed (not one step): nothing would serve the queue
            self._fail_fatal(e, "engine thread died")
        finally:
            self._outbox.owner = None
            self._outbox.flush()

    def _stall(self, gc_before: tuple[float, int], late_before: int, dynamic_before: int) -> None:
        engine = self.engine
        self.stats.num_slow_steps += 1
        self.stats.slow_step_seconds += self._step_seconds
        arm = getattr(engine, "arm", None)
        self._stalls.log(self._step_seconds, gc_before,
                         f"{len(engine.running)} running, {len(engine.waiting)} waiting, auto's arm "
                         f"{arm.name if arm is not None else '-'}, static programs made in it "
                         f"{len(engine.graphs.late_keys) - late_before}, dynamic forwards in it (no static program fitted) "
                         f"{self.engine.stage_times.dynamic_forwards - dynamic_before}")

    def _fail_fatal(self, error: BaseException, what: str) -> None:
        """The instance stops serving: every running and queued request gets a final UNAVAILABLE error naming
        the error, and submit() answers every later one at once (Triton 2.51's Python backend cannot mark a
        model not ready; the ddtree_engine_healthy gauge drops to 0 instead)."""
        with self._lock:
            if self.fatal_error is not None:
                return
            self.fatal_error = f"{type(error).__name__}: {error}"
        jobs = list(self._active.values())
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                jobs.append(job)
        logger.error("%s: fatal engine error %s; this instance no longer serves; failing %d requests: %s", what,
                     self.fatal_error, len(jobs), ", ".join(job.request_id for job in jobs) or "none",
                     exc_info=(type(error), error, error.__traceback__))
        message = f"engine failed with a fatal error ({self.fatal_error}); this instance no longer serves"
        for job in jobs:
            try:
                if job.engine_request is not None:
                    self.engine.abort(job.key)
                else:
                    with self._lock:
                        self._num_queued -= 1
                self._finish(job, "unavailable", message)
            except Exception:  # keep failing the others
                logger.exception("[%s] could not send the fatal error", job.request_id)
        self.stats.engine_healthy = 0
        self._report_safely()

    def _report_safely(self) -> None:
        try:
            self._report()
        except Exception:
            logger.exception("could not report the metrics after the fatal error")

    def _take_jobs(self, block: bool) -> None:
        if not block and not self._jobs.queue:   # nothing queued (most rounds): no lock, no queue.Empty raised and caught
            return
        try:
            job = self._jobs.get(block=block)
            while True:
                if job is None:
                    self._stopping = True
                    return
                self._start(job)
                job = self._jobs.get_nowait()
        except queue.Empty:
            return

    def _start(self, job: Job) -> None:
        req, rid = job.request, job.request_id
        job.taken_s = time.perf_counter()
        params = req.params
        logger.info("[%s] start: %d prompt tokens, mode %s, budget %d, max_tokens %d, temperature %.2f",
                    rid, len(req.prompt_ids), params.mode, params.tree_budget, params.max_tokens, params.temperature)
        job.engine_request = Request(request_id=job.key, prompt_ids=req.prompt_ids, params=params)
        job.stream = _Stream(self.tokenizer, req, job.key)
        job.text_on_outbox = self._text_on_outbox and not params.stop
        with self._lock:
            self._num_queued -= 1
        try:
            if job.is_stopped or job.sink.is_cancelled():
                raise _Cancelled
            self.engine.add(job.engine_request)
        except _Cancelled:
            self._finish(job, "cancelled")
            return
        except InvalidRequest as e:
            self._finish(job, "invalid", str(e))
            return
        self._active[job.key] = job

    def _step(self) -> None:
        try:
            start = time.perf_counter()
            self._step_seconds = 0.0
            outputs = self.engine.step()
            self._step_seconds = time.perf_counter() - start
            if self._fault_after_rounds is not None and self.engine.stage_times.batch_rounds >= self._fault_after_rounds:
                raise RuntimeError("CUDA error: an illegal memory access was encountered "
                                   "(simulated by the test-only fault_injection parameter)")
        except Exception as e:  # the edge: every running request gets the error, the engine is emptied
            if is_fatal(e):
                self._fail_fatal(e, "engine step failed")
                return
            logger.exception("engine step failed; failing %d requests: %s", len(self._active),
                             ", ".join(job.request_id for job in self._active.values()))
            for job in list(self._active.values()):
                self.engine.abort(job.key)
                self._finish(job, "internal", f"engine error: {type(e).__name__}: {e}")
            return
        # a streamed response at most every this many seconds per stream (engine knob stream_response_rate)
        rate = self._response_rate
        min_gap_s = sum(1 for job in self._active.values() if job.request.stream) / rate if rate else 0.0
        now = time.monotonic()
        check_s = cancel_check_interval(len(self._active))
        for output in outputs:
            job = self._active.get(output.request_id)
            if job is None:
                continue
            self.stats.num_output_tokens += len(output.new_token_ids)
            if not job.first_token and output.new_token_ids:
                job.first_token = True
                if self.on_stats is not None:
                    request = job.engine_request
                    self.stats.ttft_seconds.append(time.perf_counter() - job.arrival_s)
                    self.stats.queue_seconds.append(max(request.prefill_start_s - job.arrival_s, 0.0))
                    self.stats.prefill_seconds.append(request.prefill_end_s - request.prefill_start_s)
                    self.stats.take_seconds.append(max(job.taken_s - job.arrival_s, 0.0))
            try:
                if job.is_stopped:
                    self.engine.abort(job.key)
                    self._finish(job, "cancelled")
                    continue
                if not job.check_queued and now - job.checked_s > check_s:
                    job.check_queued = True
                    self._outbox.put(self._check_cancelled, job)
                if job.send_failed:     # an earlier response of it could not be sent (the outbox logged why)
                    self.engine.abort(job.key)
                    self._finish(job, "failed")
                    continue
                if job.text_on_outbox:   # its stream is the outbox's alone: its end is the engine's
                    self._outbox.put(self._build_and_send, job, output, now, min_gap_s)
                    finish_reason = output.finish_reason
                else:
                    chunk = job.stream.add(output, now, min_gap_s)
                    finish_reason = job.stream.finish_reason
                    if chunk is not None:
                        self._outbox.put(self._send, job, chunk, finish_reason is not None)
            except Exception as e:  # a failure here concerns this request only
                logger.exception("[%s] could not build a response; dropping the request", job.request_id)
                self.engine.abort(job.key)
                self._finish(job, "internal", f"could not build a response: {type(e).__name__}: {e}")
                continue
            if finish_reason is not None:
                self._end(job, finish_reason)

    def _cancelled(self, job: Job) -> bool:
        job.checked_s = start = time.monotonic()
        try:
            return job.sink.is_cancelled()
        finally:
            self.stats.cancel_check_seconds += time.monotonic() - start
            self.stats.num_cancel_checks += 1

    def _check_cancelled(self, job: Job) -> None:
        """On the outbox thread: a cancelled client stops the request at the engine's next round."""
        job.check_queued = False
        if self._cancelled(job):
            job.is_stopped = True

    def _send(self, job: Job, chunk: dict[str, Any], final: bool) -> None:
        """On the outbox thread: one response, then, where it was last asked over cancel_check_interval ago, whether the
        client cancelled (the engine stops the request at its next round; asking is an IPC round trip in Triton, as the
        send is: after every send it doubled the outbox's calls at many streams); a failure drops the request at the
        engine's next round."""
        self.stats.num_responses += 1
        try:
            start = time.monotonic()
            try:
                job.sink.send(chunk, final=final)
            finally:
                self.stats.send_seconds += time.monotonic() - start
            # a request the engine has finished (the outbox can lag behind it) is not asked
            active = self._active
            if not final and job.key in active and time.monotonic() - job.checked_s > cancel_check_interval(len(active)) \
                    and self._cancelled(job):
                job.is_stopped = True
        except Exception:
            logger.exception("[%s] could not send a response; dropping the request", job.request_id)
            job.send_failed = True

    def _build_and_send(self, job: Job, output: RequestOutput, now: float, min_gap_s: float) -> None:
        """On the outbox thread: a request's response built from its round (text_on_outbox) and sent. A failure ends
        the client's stream with an error and drops the request at the engine's next round."""
        if job.send_failed:
            return
        try:
            chunk = job.stream.add(output, now, min_gap_s)
        except Exception as e:
            logger.exception("[%s] could not build a response; dropping the request", job.request_id)
            job.send_failed = True
            self._send_error(job, f"could not build a response: {type(e).__name__}: {e}", "internal")
            return
        if chunk is not None:
            self._send(job, chunk, output.is_finished)

    def _send_error(self, job: Job, message: str, kind: str) -> None:
        start = time.monotonic()
        try:
            job.sink.send_error(message, kind)
        except Exception:
            logger.exception("[%s] could not send its final error (%s)", job.request_id, kind)
        finally:
            self.stats.send_seconds += time.monotonic() - start

    def _end(self, job: Job, finish_reason: str) -> None:
        """A request whose text is complete; one the engine still runs (a stop string) leaves it now."""
        if job.engine_request.finish_reason is None:
            self.engine.abort(job.key)
        job.engine_request.finish_reason = finish_reason
        self._finish(job, "done")

    def _finish(self, job: Job, outcome: str, message: str = "") -> None:
        """Every job ends here exactly once: log, count, and (unless done) one final error response."""
        self._active.pop(job.key, None)
        with self._lock:
            self._by_key.pop(job.key, None)
        request, rid = job.engine_request, job.request_id
        if outcome == "done":
            self.stats.num_finished += 1
            seconds = time.perf_counter() - job.arrival_s
            if self.on_stats is not None:
                self.stats.latency_seconds.append(seconds)
            logger.info("[%s] done: %d tokens in %.3f s, %d rounds, mean acceptance %.2f, finish %s", rid,
                        request.num_output_tokens, seconds, len(request.acceptance_lengths),
                        request.mean_acceptance_length, request.finish_reason)
            return
        if outcome == "cancelled":
            self.stats.num_cancelled += 1
            tokens = request.num_output_tokens if request else 0
            logger.info("[%s] cancelled after %d tokens; request freed", rid, tokens)
            self._outbox.put(self._send_error, job, "request cancelled", "cancelled")
            return
        self.stats.num_failed += 1
        if outcome == "invalid":
            logger.info("[%s] rejected: %s", rid, message)
            self._outbox.put(self._send_error, job, message, "invalid")
        elif outcome in ("internal", "unavailable"):
            self._outbox.put(self._send_error, job, message, outcome)


class _Cancelled(Exception):
    pass


class _Stream:
    """Builds response outputs from rounds: streamed deltas, or one response at the end.

    Text is followed round by round either way, so that a stop string ends the request at the
    round that completes it (finish_reason "stop"; the service then frees its slot). A streamed
    request with stream_interval k gets its first text at once, then a response every k rounds
    (and its end): the text of the rounds in between travels as one chunk, a window from the
    first held chunk's context to the newest id, which decode_range turns into the same text.
    Under a stream_response_rate, a response also waits its stream's share of that rate.
    """

    def __init__(self, tokenizer, req: api.GenerateRequest, key: str = "") -> None:
        self.req, self.key = req, key   # key: the request's, which the postprocessing step relays a cancellation by
        self.detokenizer = IncrementalDetokenizer(tokenizer, req.params.stop, req.params.min_tokens)
        self.unsent_tokens = 0
        self.echo = req.echo_text
        self.finish_reason: str | None = None
        self.interval = req.params.stream_interval
        self.held: tuple[int, int, int, str] | None = None   # (window start id, prefix length, text start, text)
        self.rounds_unsent = 0
        self.sent_text = False
        self.sent_s = float("-inf")   # when its last response was built (time.monotonic)

    def add(self, output: RequestOutput, now: float = 0.0, min_gap_s: float = 0.0) -> dict[str, Any] | None:
        """This round's response outputs, or None while its text is held (a streamed request's next response is due
        every `interval` rounds and at least `min_gap_s` after the last one, `now` on time.monotonic's clock)."""
        self.unsent_tokens += len(output.new_token_ids)
        chunk = self.detokenizer.push(output.new_token_ids, is_final=output.is_finished)
        self.finish_reason = "stop" if chunk.stopped else output.finish_reason
        if not self.req.stream:
            if self.finish_reason is None:
                return None
            chunk = self.detokenizer.whole_chunk()
        else:
            chunk = self._held_chunk(chunk, now, min_gap_s)
            if chunk is None:
                return None
        if self.req.text_output:   # the text itself (no postprocessing step after this model)
            outputs: dict[str, Any] = {api.TEXT_OUTPUT: (self.echo or "") + chunk.text}
        else:                      # what the postprocessing step turns into the same text, statelessly
            outputs = {api.OUTPUT_IDS: chunk.window, api.PREFIX_LENGTH: chunk.prefix_length,
                       api.TEXT_START: chunk.text_start, api.TEXT_END: chunk.text_end, api.PROMPT_TEXT: self.echo or "",
                       api.REQUEST_KEY: self.key}
        self.echo = None
        flags = self.req.return_flags
        if flags["return_finish_reason"]:
            outputs[api.FINISH_REASON] = self.finish_reason or ""
        if flags["return_num_input_tokens"]:
            outputs[api.NUM_INPUT_TOKENS] = output.num_input_tokens
        if flags["return_num_output_tokens"]:
            outputs[api.NUM_OUTPUT_TOKENS] = self.unsent_tokens
        if flags["return_acceptance_stats"]:
            outputs[api.MEAN_ACCEPTANCE_LENGTH] = output.mean_acceptance_length
            outputs[api.NUM_ROUNDS] = output.num_rounds
        self.unsent_tokens = 0
        return outputs

    def _held_chunk(self, chunk: StreamChunk, now: float, min_gap_s: float) -> StreamChunk | None:
        """The streamed chunk to send after this round, or None to hold its text until the interval is due."""
        self.rounds_unsent += 1
        if chunk.text:
            start = len(self.detokenizer.ids) - len(chunk.window)
            self.held = ((start, chunk.prefix_length, chunk.text_start, chunk.text) if self.held is None else
                         self.held[:3] + (self.held[3] + chunk.text,))
        due = self.finish_reason is not None or (self.held is not None and (
            not self.sent_text or (self.rounds_unsent >= self.interval and now - self.sent_s >= min_gap_s)))
        if not due:
            return None
        self.rounds_unsent, self.sent_s = 0, now
        if self.held is None:   # the end, with no text left to send
            return chunk
        start, prefix_length, text_start, text = self.held
        self.held, self.sent_text = None, True
        return StreamChunk(self.detokenizer.ids[start:], prefix_length, text, text_start, text_start + len(text))
