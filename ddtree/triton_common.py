"""Small helpers shared by the Triton adapters; pb_utils is passed in, never imported here."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def project_root(args: dict) -> Path:
    """Relative paths in config.pbtxt are relative to the directory holding the model repository."""
    return Path(args["model_repository"]).resolve().parent.parent


def resolve_path(path: str, args: dict) -> str:
    return path if Path(path).is_absolute() else str((project_root(args) / path).resolve())


def load_tokenizer(path: str):
    from ddtree.tokenizer import Tokenizer

    return Tokenizer(path)


def string_input(pb_utils, request, name: str) -> bytes | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy().reshape(-1)
    if array.size == 0:
        return None
    value = array[0]
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def plain_inputs(pb_utils, request, names: dict[str, str]) -> dict[str, Any]:
    """Read the named inputs as plain values; kinds: 'ids', 'bytes', 'bool'."""
    values: dict[str, Any] = {}
    for name, kind in names.items():
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            continue
        array = tensor.as_numpy().reshape(-1)
        if kind == "ids":
            values[name] = array.tolist()
        elif kind == "bytes":
            values[name] = string_input(pb_utils, request, name)
        elif array.size:
            values[name] = bool(array[0])
    return values


def output_tensors(pb_utils, outputs: dict[str, Any]) -> list:
    """Plain output values -> pb_utils.Tensor list with the dtypes of config.pbtxt."""
    kinds = {"output_ids": np.int32, "prefix_length": np.int32, "text_start": np.int32, "text_end": np.int32,
             "num_input_tokens": np.uint32, "num_output_tokens": np.uint32, "num_rounds": np.uint32,
             "mean_acceptance_length": np.float32}
    tensors = []
    for name, value in outputs.items():
        if isinstance(value, str):
            array = np.array([value.encode("utf-8")], dtype=np.object_)
        elif isinstance(value, list):
            array = np.array(value, dtype=kinds[name])
        else:
            array = np.array([value], dtype=kinds[name])
        tensors.append(pb_utils.Tensor(name, array))
    return tensors


class TritonLogHandler(logging.Handler):
    """Forwards the package's log records to Triton's log with a [ddtree] prefix."""

    def __init__(self, pb_utils) -> None:
        super().__init__()
        self.logger = pb_utils.Logger

    def emit(self, record: logging.LogRecord) -> None:
        message = f"[ddtree] {self.format(record)}"
        if record.levelno >= logging.ERROR:
            self.logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            self.logger.log_warn(message)
        elif record.levelno >= logging.INFO:
            self.logger.log_info(message)
        else:
            self.logger.log_verbose(message)


def instance_device(args: dict, device: str) -> str:
    """The device of this model instance: a KIND_GPU instance runs on its own GPU (one replica per GPU)."""
    if args.get("model_instance_kind") == "GPU" and device.startswith("cuda"):
        return f"cuda:{args['model_instance_device_id']}"
    return device


class TritonMetrics:
    """Prometheus metrics through Triton's custom-metrics API (skipped when metrics are off; 2.51 has HISTOGRAM).

    Tokens per drafting round per request: ddtree_acceptance_length (_sum / _count); tree nodes per round:
    ddtree_tree_nodes_total / ddtree_rounds_total; host time per batch round: ddtree_host_seconds_total /
    ddtree_batch_rounds_total; tokens/s: rate(ddtree_output_tokens_total).
    """

    GAUGES = (("ddtree_active_requests", "num_active", "Requests holding a cache slot"),
              ("ddtree_waiting_requests", "num_waiting", "Requests waiting for a slot"),
              ("ddtree_held_cache_slots", "num_held_slots", "Cache slots in use"),
              ("ddtree_engine_healthy", "engine_healthy", "1 while the engine serves, 0 after a fatal engine error"))
    COUNTERS = (("ddtree_output_tokens_total", "num_output_tokens", "Tokens generated"),
                ("ddtree_responses_total", "num_responses",
                 "Responses with outputs sent (streamed deltas and finals, not errors): their rate is what "
                 "stream_response_rate bounds, one postprocessing execution each through the ensemble"),
                ("ddtree_rounds_total", "num_rounds", "Decoding rounds, summed over requests"),
                ("ddtree_batch_rounds_total", "num_batch_rounds", "Decoding rounds of the whole batch"),
                ("ddtree_tree_nodes_total", "num_tree_nodes", "Draft tree nodes verified"),
                ("ddtree_draft_seconds_total", "draft_seconds", "Drafter time"),
                ("ddtree_draft_gpu_seconds_total", "draft_gpu_seconds",
                 "CUDA: the drafts' GPU timeline, from the drafter's launch to the top-k read (draft time less this: "
                 "the wait for the last round's commit on the device)"),
                ("ddtree_verify_seconds_total", "verify_seconds", "Target verify time"),
                ("ddtree_verify_gpu_seconds_total", "verify_gpu_seconds",
                 "CUDA: the verifies' GPU timeline (verify time less this: the host waking up after them)"),
                ("ddtree_host_seconds_total", "host_seconds", "Decoding round time outside drafter and verify passes"),
                ("ddtree_serve_seconds_total", "serve_seconds",
                 "Engine-thread time outside engine steps: streaming responses, cancellation checks, metrics"),
                ("ddtree_requests_finished_total", "num_finished", "Requests finished"),
                ("ddtree_requests_cancelled_total", "num_cancelled", "Requests cancelled"),
                ("ddtree_requests_failed_total", "num_failed", "Requests failed or rejected"),
                ("ddtree_requests_overloaded_total", "num_rejected_overload", "Requests refused: queue full"),
                ("ddtree_static_programs_late_total", "num_late_programs",
                 "Static programs made while serving (shapes the warm-up did not prepare, e.g. trees of several "
                 "requests): each compiled, and on CUDA captured as a graph, on a request's time"),
                ("ddtree_slow_steps_total", "num_slow_steps",
                 "Engine steps over 10x the recent steps' mean time and over 50 ms (stalls of every stream; each logged)"),
                ("ddtree_slow_step_seconds_total", "slow_step_seconds", "Time of those steps"),
                ("ddtree_gc_seconds_total", "gc_seconds",
                 "The model process's garbage collections, whichever thread's allocations set them off"),
                ("ddtree_gc_full_collections_total", "num_full_gcs",
                 "Of those, full collections (they walk every object the warm-up's freeze_heap did not freeze)"),
                ("ddtree_response_send_seconds_total", "send_seconds",
                 "Seconds the sending thread spent handing responses and errors to Triton (the outbox thread; with "
                 "engine_process the stub's relay thread): per second of wall time, how busy sending keeps it"),
                ("ddtree_cancel_check_seconds_total", "cancel_check_seconds",
                 "Seconds the sending thread spent asking Triton whether clients cancelled (an IPC round trip each)"),
                ("ddtree_cancel_checks_total", "num_cancel_checks",
                 "Clients' cancellation asked by the sending thread (besides, in process, once as each request starts)"),
                ("ddtree_metrics_publish_seconds_total", "metrics_publish_seconds",
                 "Seconds the model's process spent publishing these metrics to Triton (an IPC call per changed counter "
                 "and per histogram sample, on a thread of their own), as of the update before this one"),
                ("ddtree_metrics_publishes_total", "num_metrics_publishes", "Updates of these metrics published"),
                ("ddtree_dynamic_forwards_total", "num_dynamic_forwards",
                 "Drafter passes and verifies that no static program fitted, run by the dynamic forward while static "
                 "forwards are on (CUDA): eager launches, and kernels at shapes warm-up never ran"))
    HISTOGRAMS = (("ddtree_acceptance_length", "acceptance_histogram",
                   "Tokens committed per drafting round per request (dflash and ddtree rounds; an ar step commits one "
                   "token and counts in ddtree_rounds_total only)"),
                  ("ddtree_time_to_first_token_seconds", "ttft_seconds",
                   "Seconds from a request's arrival at the generation model to its first generated token (queue and "
                   "prefill; not the ensemble's pre- and postprocessing)"),
                  ("ddtree_request_latency_seconds", "latency_seconds",
                   "Seconds from a request's arrival at the generation model to its last token (finished requests)"),
                  ("ddtree_request_queue_seconds", "queue_seconds",
                   "Of a request's time to first token: from its arrival at the generation model to the start of the "
                   "prefill that admits it (the engine's queue, a full batch, the step in progress)"),
                  ("ddtree_request_prefill_seconds", "prefill_seconds",
                   "Of a request's time to first token: the prefill that admits it (with the others that step admits) "
                   "to its first token known (a greedy request's read after the others' round of that step)"),
                  ("ddtree_request_take_seconds", "take_seconds",
                   "Of a request's queue time: from its arrival at the generation model to the engine thread taking it "
                   "(the step in progress when it came); the rest waits for a free slot or the next step's prefill"))
    SECONDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0]   # vLLM's time-to-first-token buckets
    BUCKETS = {"acceptance_histogram": {"buckets": [float(length) for length in range(1, 18)]},
               "ttft_seconds": {"buckets": SECONDS}, "latency_seconds": {"buckets": SECONDS},
               "queue_seconds": {"buckets": SECONDS}, "prefill_seconds": {"buckets": SECONDS},
               "take_seconds": {"buckets": SECONDS}}
    # counters with one series per key of a {key: count} field, the key as the label `label`
    KEYED_COUNTERS = (("ddtree_auto_arm_rounds_total", "auto_arm_rounds", "arm",
                       "Batch rounds of mode auto per arm it ran (ar, dflash, ddtree-<budget>, policy)"),
                      ("ddtree_auto_arm_seconds_total", "auto_arm_seconds", "arm",
                       "Seconds charged to mode auto's rounds per arm (from the previous round's end: what it measures "
                       "each arm by)"))

    def __init__(self, pb_utils, lock, labels: dict[str, str], keys: dict[str, list[str]] | None = None) -> None:
        """keys: the label values of each keyed counter's field (e.g. {"auto_arm_rounds": the configured arms})."""
        self.pb_utils, self.lock, self.last, self.metrics = pb_utils, lock, {}, []
        self.keyed: list[tuple[object, str, dict]] = []   # (family, field, {key: metric})
        kinds = pb_utils.MetricFamily
        try:
            # update order = this order: a scrape that sees a request finished (a counter) and the engine idle
            # (a gauge) also sees that request's rounds in the histogram (an update is not atomic to scrapes)
            for kind, table in ((kinds.HISTOGRAM, self.HISTOGRAMS), (kinds.COUNTER, self.COUNTERS), (kinds.GAUGE, self.GAUGES)):
                for name, field, text in table:
                    family = pb_utils.MetricFamily(name, text, kind)
                    self.metrics.append((family, family.Metric(labels=labels, **self.BUCKETS.get(field, {})), field, kind))
            for name, field, label, text in self.KEYED_COUNTERS:
                family = pb_utils.MetricFamily(name, text, kinds.COUNTER)
                self.keyed.append((family, field, {key: family.Metric(labels={**labels, label: key})
                                                   for key in (keys or {}).get(field, [])}))
        except Exception:  # metrics disabled on the server
            self.metrics, self.keyed = [], []

    def update(self, stats) -> None:
        """Publish what changed since the last update. The lock (the stub's IPC lock) is taken per IPC call, not for
        the whole update (tens of calls): a response sent meanwhile waits for one call at most. Called from one thread
        at a time (the engine process's metrics thread, or the outbox in process)."""
        pb_utils, lock = self.pb_utils, self.lock
        for _, metric, field, kind in self.metrics:
            value, last = getattr(stats, field), self.last.get(field)
            if last == value:
                continue
            if kind == pb_utils.MetricFamily.GAUGE:
                with lock:
                    metric.set(value)
            elif kind == pb_utils.MetricFamily.COUNTER:
                if value < (last or 0):   # a counter never goes down (Triton refuses it, and the fields after it
                    continue              # went unpublished): counted on from its highest value once past it
                with lock:
                    metric.increment(value - (last or 0))
            elif isinstance(value, list):   # a histogram of samples: those observed since the last snapshot
                for sample in value:
                    with lock:
                        metric.observe(sample)
                continue
            else:   # a histogram: observe what was added since the last update ({length: rounds})
                for length, count in value.items():
                    for _ in range(count - (last or {}).get(length, 0)):
                        with lock:
                            metric.observe(length)
            self.last[field] = value
        for _, field, metrics in self.keyed:
            value, last = getattr(stats, field), self.last.get(field) or {}
            for key, count in value.items():
                if key in metrics and count != last.get(key, 0):
                    with lock:
                        metrics[key].increment(count - last.get(key, 0))
            self.last[field] = value
