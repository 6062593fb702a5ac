"""GenerationService: the engine behind a queue and a worker thread, streaming to response sinks.

Triton-agnostic: the generation model wraps Triton's response sender in a ResponseSink, and
tests can use any object with the same three methods.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from ddtree import api
from ddtree.detokenize import IncrementalDetokenizer
from ddtree.engine import Engine
from ddtree.errors import InvalidRequest
from ddtree.request import Request, RequestOutput

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


@dataclass(slots=True)
class ServiceStats:
    num_active: int = 0
    num_waiting: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_output_tokens: int = 0
    num_rounds: int = 0


class GenerationService:
    def __init__(self, engine: Engine, tokenizer, on_stats=None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.stats = ServiceStats()
        self.on_stats = on_stats          # called after each change of stats (metrics)
        self.is_healthy = True
        self._lock = threading.Lock()
        self._by_key: dict[str, Job] = {}
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
        self._worker.start()

    def submit(self, request_id: str, request: api.GenerateRequest, sink: ResponseSink) -> None:
        key = uuid.uuid4().hex
        # Stats are reported from the worker thread only: Triton's metric calls are IPC round-trips
        # that must not race with the engine thread's own.
        job = Job(request_id, request, sink, time.perf_counter(), key)
        with self._lock:
            self.stats.num_waiting += 1
            self._by_key[key] = job
        self._jobs.put(job)

    def stop(self, key: str) -> bool:
        """Stop the request with this key at its next round (Triton ensembles do not pass a
        client's cancellation to a running step; the postprocessing step relays it here)."""
        with self._lock:
            job = self._by_key.get(key)
        if job is not None:
            job.is_stopped = True
        return job is not None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._jobs.put(None)
        self._worker.join(timeout_s)

    def _report(self) -> None:
        if self.on_stats is not None:
            self.on_stats(self.stats)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self.stats.num_waiting -= 1
                self.stats.num_active += 1
            self._report()
            try:
                self._run(job)
            finally:
                with self._lock:
                    self.stats.num_active -= 1
                    self._by_key.pop(job.key, None)
                self._report()

    def _run(self, job: Job) -> None:
        req, sink, rid = job.request, job.sink, job.request_id
        params = req.params
        logger.info("[%s] start: %d prompt tokens, mode %s, budget %d, max_tokens %d, temperature %.2f",
                    rid, len(req.prompt_ids), params.mode, params.tree_budget, params.max_tokens, params.temperature)
        request = Request(request_id=rid, prompt_ids=req.prompt_ids, params=params)
        stream = _Stream(self.tokenizer, req)
        try:
            if job.is_stopped or sink.is_cancelled():
                raise _Cancelled
            for output in self.engine.generate(request):
                self.stats.num_output_tokens += len(output.new_token_ids)
                if job.is_stopped or sink.is_cancelled():
                    raise _Cancelled
                chunk = stream.add(output)
                if chunk is not None:
                    chunk[api.REQUEST_KEY] = job.key
                    sink.send(chunk, final=output.is_finished)
            self.stats.num_finished += 1
            self.stats.num_rounds += len(request.acceptance_lengths)
            elapsed = time.perf_counter() - job.arrival_s
            logger.info("[%s] done: %d tokens in %.3f s, %d rounds, mean acceptance %.2f, finish %s", rid,
                        request.num_output_tokens, elapsed, len(request.acceptance_lengths),
                        request.mean_acceptance_length, request.finish_reason)
        except _Cancelled:
            self.stats.num_cancelled += 1
            logger.info("[%s] cancelled after %d tokens; request freed", rid, request.num_output_tokens)
            sink.send_error("request cancelled", "cancelled")
        except InvalidRequest as e:
            self.stats.num_failed += 1
            logger.info("[%s] rejected: %s", rid, e)
            sink.send_error(str(e), "invalid")
        except Exception as e:  # the edge: report, keep serving
            self.stats.num_failed += 1
            logger.exception("[%s] engine error", rid)
            sink.send_error(f"engine error: {type(e).__name__}: {e}", "internal")


class _Cancelled(Exception):
    pass


class _Stream:
    """Builds response outputs from rounds: streamed deltas, or one response at the end."""

    def __init__(self, tokenizer, req: api.GenerateRequest) -> None:
        self.req = req
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.pending_ids: list[int] = []
        self.unsent_tokens = 0
        self.echo = req.echo_text

    def add(self, output: RequestOutput) -> dict[str, Any] | None:
        self.unsent_tokens += len(output.new_token_ids)
        if not self.req.stream:
            self.pending_ids.extend(output.new_token_ids)
            if not output.is_finished:
                return None
            chunk = self.detokenizer.push(self.pending_ids, is_final=True)
        else:
            chunk = self.detokenizer.push(output.new_token_ids, is_final=output.is_finished)
            if not chunk.text and not output.is_finished:
                return None
        outputs: dict[str, Any] = {
            api.OUTPUT_IDS: chunk.window, api.PREFIX_LENGTH: chunk.prefix_length,
            api.PROMPT_TEXT: self.echo or "",
        }
        self.echo = None
        flags = self.req.return_flags
        if flags["return_finish_reason"]:
            outputs[api.FINISH_REASON] = output.finish_reason or ""
        if flags["return_num_input_tokens"]:
            outputs[api.NUM_INPUT_TOKENS] = output.num_input_tokens
        if flags["return_num_output_tokens"]:
            outputs[api.NUM_OUTPUT_TOKENS] = self.unsent_tokens
        if flags["return_acceptance_stats"]:
            outputs[api.MEAN_ACCEPTANCE_LENGTH] = output.mean_acceptance_length
            outputs[api.NUM_ROUNDS] = output.num_rounds
        self.unsent_tokens = 0
        return outputs
