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
