"""Triton adapter: (window ids, prefix length) -> the exact text delta (stateless)."""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ddtree import api  # noqa: E402
from ddtree.detokenize import decode_delta  # noqa: E402
from ddtree.triton_common import load_tokenizer, model_parameters, resolve_path, string_input  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tokenizer = load_tokenizer(resolve_path(params["tokenizer_path"], args))

    def execute(self, requests):
        responses = []
        for request in requests:
            window = pb_utils.get_input_tensor_by_name(request, api.OUTPUT_IDS).as_numpy().tolist()
            prefix_length = int(pb_utils.get_input_tensor_by_name(request, api.PREFIX_LENGTH).as_numpy()[0])
            prompt_text = (string_input(pb_utils, request, api.PROMPT_TEXT) or b"").decode("utf-8")
            text = prompt_text + decode_delta(self.tokenizer, window, prefix_length)
            out = pb_utils.Tensor(api.TEXT_OUTPUT, np.array([text.encode("utf-8")], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
