"""Triton adapter for the DDTree engine: validate, submit, stream; nothing else lives here."""

import logging
import sys
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ddtree import api  # noqa: E402
from ddtree.config import EngineConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.errors import InvalidRequest  # noqa: E402
from ddtree.serving import GenerationService  # noqa: E402
from ddtree.triton_common import (  # noqa: E402
    TritonLogHandler,
    load_tokenizer,
    model_parameters,
    output_tensors,
    plain_inputs,
    project_root,
)

INPUTS = {api.INPUT_IDS: "ids", api.STOP_REQUEST_KEY: "bytes", api.TEXT_INPUT: "bytes", api.STREAM: "bool",
          api.SAMPLING_PARAMETERS: "bytes", api.EXCLUDE_INPUT_IN_OUTPUT: "bool",
          **{name: "bool" for name in api.RETURN_FLAGS}}
# The stub's IPC with the server is not safe to enter from two threads at once (a metric update
# racing a send crashed the backend): every pb_utils call after initialize goes through this lock.
IPC_LOCK = threading.Lock()
ERROR_CODES = {"invalid": "INVALID_ARG", "cancelled": "CANCELLED", "internal": "INTERNAL",
               "unavailable": "UNAVAILABLE"}


class TritonSink:
    """A Triton response sender seen as a ddtree.serving.ResponseSink."""

    def __init__(self, sender):
        self.sender = sender

    def is_cancelled(self):
        with IPC_LOCK:
            return self.sender.is_cancelled()

    def send(self, outputs, final):
        response = pb_utils.InferenceResponse(output_tensors(pb_utils, outputs))
        with IPC_LOCK:
            self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def send_error(self, message, kind, final=True):
        error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, ERROR_CODES[kind]))
        with IPC_LOCK:
            self.sender.send(pb_utils.InferenceResponse(error=error),
                             flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)


class TritonPythonModel:
    def initialize(self, args):
        package_logger = logging.getLogger("ddtree")
        package_logger.setLevel(logging.INFO)
        package_logger.addHandler(TritonLogHandler(pb_utils))
        params = model_parameters(args)
        fault_injection = params.pop("fault_injection", "")   # TEST ONLY (ddtree.serving.parse_fault_injection)
        self.config = EngineConfig.from_dict(params, base_dir=project_root(args))
        package_logger.info("engine config: %s", self.config)
        engine = Engine(self.config)
        self.metrics = _Metrics(args["model_name"])
        self.service = GenerationService(engine, load_tokenizer(self.config.target_path), self.metrics.update,
                                         max_queue_size=self.config.max_queue_size, fault_injection=fault_injection)
        self.num_requests = 0

    def execute(self, requests):
        for request in requests:
            self.num_requests += 1
            request_id = request.request_id() or f"req-{self.num_requests}"
            sink = TritonSink(request.get_response_sender())
            inputs = plain_inputs(pb_utils, request, INPUTS)
            if api.STOP_REQUEST_KEY in inputs:
                found = self.service.stop(inputs[api.STOP_REQUEST_KEY].decode("utf-8", "replace"))
                with IPC_LOCK:
                    sink.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                logging.getLogger("ddtree").info("[%s] stop request: %s", request_id, "found" if found else "no such key")
                continue
            try:
                parsed = api.parse_generate(inputs, self.config)
            except InvalidRequest as e:
                logging.getLogger("ddtree").info("[%s] rejected: %s", request_id, e)
                sink.send_error(str(e), "invalid")
                continue
            self.service.submit(request_id, parsed, sink)
        return None

    def finalize(self):
        self.service.shutdown()


class _Metrics:
    """Prometheus metrics through Triton's custom-metrics API (skipped when metrics are off; 2.51 has HISTOGRAM).

    Tokens per round per request: ddtree_acceptance_length (_sum / _count); tree nodes per round:
    ddtree_tree_nodes_total / ddtree_rounds_total; host time per batch round: ddtree_host_seconds_total /
    ddtree_batch_rounds_total; tokens/s: rate(ddtree_output_tokens_total).
    """

    GAUGES = (("ddtree_active_requests", "num_active", "Requests holding a cache slot"),
              ("ddtree_waiting_requests", "num_waiting", "Requests waiting for a slot"),
              ("ddtree_held_cache_slots", "num_held_slots", "Cache slots in use"),
              ("ddtree_engine_healthy", "engine_healthy", "1 while the engine serves, 0 after a fatal engine error"))
    COUNTERS = (("ddtree_output_tokens_total", "num_output_tokens", "Tokens generated"),
                ("ddtree_rounds_total", "num_rounds", "Decoding rounds, summed over requests"),
                ("ddtree_batch_rounds_total", "num_batch_rounds", "Decoding rounds of the whole batch"),
                ("ddtree_tree_nodes_total", "num_tree_nodes", "Draft tree nodes verified"),
                ("ddtree_draft_seconds_total", "draft_seconds", "Drafter time"),
                ("ddtree_verify_seconds_total", "verify_seconds", "Target verify time"),
                ("ddtree_host_seconds_total", "host_seconds", "Decoding round time outside drafter and verify passes"),
                ("ddtree_requests_finished_total", "num_finished", "Requests finished"),
                ("ddtree_requests_cancelled_total", "num_cancelled", "Requests cancelled"),
                ("ddtree_requests_failed_total", "num_failed", "Requests failed or rejected"),
                ("ddtree_requests_overloaded_total", "num_rejected_overload", "Requests refused: queue full"))
    HISTOGRAMS = (("ddtree_acceptance_length", "acceptance_histogram", "Tokens committed per round per request"),)
    BUCKETS = {"acceptance_histogram": {"buckets": [float(length) for length in range(1, 18)]}}

    def __init__(self, model_name):
        labels, self.last, self.metrics = {"model": model_name}, {}, []
        kinds = pb_utils.MetricFamily
        try:
            for kind, table in ((kinds.GAUGE, self.GAUGES), (kinds.COUNTER, self.COUNTERS), (kinds.HISTOGRAM, self.HISTOGRAMS)):
                for name, field, text in table:
                    family = pb_utils.MetricFamily(name, text, kind)
                    self.metrics.append((family, family.Metric(labels=labels, **self.BUCKETS.get(field, {})), field, kind))
        except Exception:  # metrics disabled on the server
            self.metrics = []

    def update(self, stats):
        with IPC_LOCK:
            for _, metric, field, kind in self.metrics:
                value, last = getattr(stats, field), self.last.get(field)
                if last == value:
                    continue
                if kind == pb_utils.MetricFamily.GAUGE:
                    metric.set(value)
                elif kind == pb_utils.MetricFamily.COUNTER:
                    metric.increment(value - (last or 0))
                else:   # a histogram: observe what was added since the last update ({length: rounds})
                    for length, count in value.items():
                        for _ in range(count - (last or {}).get(length, 0)):
                            metric.observe(length)
                self.last[field] = value
