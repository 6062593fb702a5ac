"""Triton adapter: prompt text or chat messages -> input_ids (stateless)."""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ddtree import api  # noqa: E402
from ddtree.errors import InvalidRequest  # noqa: E402
from ddtree.triton_common import load_tokenizer, model_parameters, resolve_path, string_input  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tokenizer = load_tokenizer(resolve_path(params["tokenizer_path"], args))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                prompt = api.parse_prompt(
                    string_input(pb_utils, request, api.TEXT_INPUT),
                    string_input(pb_utils, request, api.MESSAGES),
                    string_input(pb_utils, request, api.CHAT_TEMPLATE_KWARGS),
                )
                ids = np.array(api.encode_prompt(self.tokenizer, prompt), dtype=np.int32)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(api.INPUT_IDS, ids)]))
            except InvalidRequest as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses
