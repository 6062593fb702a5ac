"""Triton adapter for the DDTree engine: validate, submit, stream; nothing else lives here."""

import dataclasses
import logging
import sys
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ddtree import api, engine_process  # noqa: E402
from ddtree.config import EngineConfig  # noqa: E402
from ddtree.errors import InvalidRequest  # noqa: E402
from ddtree.stop_registry import StopRegistry, default_directory  # noqa: E402
from ddtree.triton_common import (  # noqa: E402
    TritonLogHandler,
    TritonMetrics,
    instance_device,
    load_tokenizer,
    model_parameters,
    output_tensors,
    plain_inputs,
    project_root,
)

INPUTS = {api.INPUT_IDS: "ids", api.STOP_REQUEST_KEY: "bytes", api.TEXT_INPUT: "bytes", api.MESSAGES: "bytes",
          api.CHAT_TEMPLATE_KWARGS: "bytes", api.STREAM: "bool", api.SAMPLING_PARAMETERS: "bytes",
          api.EXCLUDE_INPUT_IN_OUTPUT: "bool",
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
        self.config = dataclasses.replace(self.config, device=instance_device(args, self.config.device))
        package_logger.info("%s engine config: %s", args["model_instance_name"], self.config)
        wanted = engine_process.wanted(self.config)
        if wanted:   # the engine in a child process (ddtree.engine_process); this one relays
            self.service = engine_process.EngineProcess(self.config, tokenizer_path=self.config.target_path,
                                                        max_queue_size=self.config.max_queue_size,
                                                        fault_injection=fault_injection,
                                                        stop_directory=default_directory(args["model_name"]))
            arm_names = self.service.arm_names
        else:   # only here does this process import the engine (torch): the child above keeps it out of the stub
            from ddtree.engine import Engine
            from ddtree.serving import GenerationService, freeze_heap

            engine = Engine(self.config)
            engine.warm_up()   # CUDA: compiles and captures the static programs before the model reports ready
            freeze_heap()      # what loading and warm-up left: never walked by a full collection again
            arm_names = [arm.name for arm in engine.arm_selector.arms]
        self.metrics = TritonMetrics(pb_utils, IPC_LOCK, {"model": args["model_name"], "instance": args["model_instance_name"]},
                                     keys={field: arm_names for field in ("auto_arm_rounds", "auto_arm_seconds")})
        if wanted:
            self.service.start(self.metrics.update)
        else:
            # the metrics on a thread of their own, as the engine process's relay publishes them: not on the outbox,
            # where every response queued behind an update (tens of IPC calls) waited for all of it
            self.publisher = engine_process.MetricsPublisher(self.metrics.update)
            self.service = GenerationService(engine, load_tokenizer(self.config.target_path),
                                             lambda stats: self.publisher.put(engine_process.stats_fields(stats)),
                                             max_queue_size=self.config.max_queue_size, fault_injection=fault_injection,
                                             stop_registry=StopRegistry(default_directory(args["model_name"])))
        # a prompt sent as text (no ensemble around this model) is tokenized here, on the execute thread
        self.tokenizer = load_tokenizer(self.config.target_path) if wanted else self.service.tokenizer
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
                logging.getLogger("ddtree").info("[%s] stop request: %s", request_id, "found" if found else "not here (marker left)")
                continue
            try:
                parsed = api.parse_generate(inputs, self.config, self.tokenizer)
            except InvalidRequest as e:
                logging.getLogger("ddtree").info("[%s] rejected: %s", request_id, e)
                sink.send_error(str(e), "invalid")
                continue
            self.service.submit(request_id, parsed, sink)
        return None

    def finalize(self):
        self.service.shutdown()
        if getattr(self, "publisher", None) is not None:
            self.publisher.close(5.0)
        if self.service.stop_registry is not None:
            self.service.stop_registry.close()
