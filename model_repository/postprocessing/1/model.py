"""Triton adapter: (window ids, prefix length, character range) -> the exact text delta (stateless)."""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ddtree import api  # noqa: E402
from ddtree.detokenize import decode_range  # noqa: E402
from ddtree.triton_common import load_tokenizer, model_parameters, resolve_path, string_input  # noqa: E402


def text_response(text: str):
    return pb_utils.InferenceResponse([pb_utils.Tensor(api.TEXT_OUTPUT, np.array([text.encode("utf-8")], dtype=np.object_))])


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tokenizer = load_tokenizer(resolve_path(params["tokenizer_path"], args))
        self.generation_model = params.get("generation_model", "ddtree")

    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():
                self.relay_cancellation(string_input(pb_utils, request, api.REQUEST_KEY))
                # an empty text, not a CANCELLED error: Triton 2.51's ensemble scheduler never completes an ensemble
                # request whose step answers a cancellation with an error (it stays in flight: a leak per cancelled
                # stream, and a shutdown that waits out its exit timeout without finalizing the models); the client
                # that cancelled sees neither
                responses.append(text_response(""))
                continue
            window = pb_utils.get_input_tensor_by_name(request, api.OUTPUT_IDS).as_numpy().tolist()
            prefix_length, text_start, text_end = (int(pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0])
                                                   for name in (api.PREFIX_LENGTH, api.TEXT_START, api.TEXT_END))
            prompt_text = (string_input(pb_utils, request, api.PROMPT_TEXT) or b"").decode("utf-8")
            text = prompt_text + decode_range(self.tokenizer, window, prefix_length, text_start, text_end)
            responses.append(text_response(text))
        return responses

    def relay_cancellation(self, key):
        if not key:
            return
        stop = pb_utils.InferenceRequest(
            model_name=self.generation_model, requested_output_names=[],
            inputs=[pb_utils.Tensor(api.STOP_REQUEST_KEY, np.array([key], dtype=np.object_))])
        for _ in stop.exec(decoupled=True):
            pass
