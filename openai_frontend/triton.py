"""One ensemble request as a gRPC stream to tritonserver (tritonclient), cancellable at any time."""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from openai_frontend.protocol import OpenAIError, error_from_triton

OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "mean_acceptance_length",
           "num_rounds")


def make_inputs(values: dict[str, str | bool]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in values.items():
        if isinstance(value, bool):
            tensor = grpcclient.InferInput(name, [1], "BOOL")
            tensor.set_data_from_numpy(np.array([value], dtype=bool))
        else:
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
        inputs.append(tensor)
    return inputs


def unreachable(url: str, error: object) -> OpenAIError:
    return OpenAIError(503, f"the inference server at {url} is not reachable: {error}", code="unavailable")


class EnsembleStream:
    """Send one request on its own gRPC stream; next() gives each response's outputs as plain values.

    close(cancel=True) cancels the request in Triton (stop_stream(cancel_requests=True)): through the
    ensemble, the postprocessing step relays the cancellation to `ddtree`, which frees the request.
    """

    def __init__(self, url: str, model: str, inputs: dict[str, str | bool], request_id: str) -> None:
        self.url = url
        self._responses: queue.Queue = queue.Queue()
        self._done = False
        self._closed = False
        try:
            self._client = grpcclient.InferenceServerClient(url)
            self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
            self._client.async_stream_infer(model, make_inputs(inputs), request_id=request_id,
                                            enable_empty_final_response=True)
        except InferenceServerException as e:
            self.close(cancel=True)
            raise unreachable(url, e) from None

    def next(self, timeout_s: float) -> dict[str, Any] | None:
        """The next response's outputs (key 'final' tells the last one); None on timeout; raises OpenAIError."""
        try:
            result, error = self._responses.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if error is not None:
            self._done = True
            status = error.status() if isinstance(error, InferenceServerException) else None
            message = str(error.message() if isinstance(error, InferenceServerException) else error)
            if status:   # the gRPC call itself failed (a model's error has no status: see error_from_triton)
                if "UNAVAILABLE" in status:
                    raise unreachable(self.url, message)
                raise OpenAIError(502, f"the inference server's stream failed ({status}): {message}",
                                  code="upstream_error")
            raise error_from_triton(message)
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        outputs: dict[str, Any] = {"final": bool(final and final.bool_param)}
        for output in response.outputs:
            if output.name not in OUTPUTS:
                continue
            array = result.as_numpy(output.name)
            if array is None or array.size == 0:
                continue
            values = array.reshape(-1).tolist()
            if output.name == "text_output":
                outputs[output.name] = b"".join(values).decode("utf-8")
            elif output.name == "finish_reason":
                outputs[output.name] = values[0].decode("utf-8")
            else:
                outputs[output.name] = values[0]
        self._done = outputs["final"]
        return outputs

    def close(self, cancel: bool = False) -> None:
        """End the stream; cancel=True (or a request that has not finished) cancels it in Triton."""
        if self._closed:
            return
        self._closed = True
        client = getattr(self, "_client", None)
        if client is None:
            return
        try:
            client.stop_stream(cancel_requests=cancel or not self._done)
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
        try:
            client.close()
        except Exception:  # noqa: BLE001
            pass
