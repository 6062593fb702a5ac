"""Per-request knobs and their validation (the vLLM sampling_parameters contract plus DDTree extras)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddtree.config import MAX_STREAM_INTERVAL, MODES, EngineConfig
from ddtree.errors import InvalidRequest

# Keys that vLLM clients commonly send and that have a no-op meaning here at their defaults.
_ACCEPTED_NOOP = {"n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "repetition_penalty": 1.0, "logprobs": None, "skip_special_tokens": True}
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: no top-k
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)     # the output ends right before the first one (text level)
    mode: str = "ddtree"
    tree_budget: int = 16
    stream_interval: int = 1            # a streamed response every this many rounds (serving only; 1 = every round)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise InvalidRequest(f"sampling_parameters.{name} must be a number, got {value!r}")
    try:
        number = kind(value) if kind is float else int(str(value).strip())
    except (TypeError, ValueError):
        raise InvalidRequest(f"sampling_parameters.{name} must be {kind.__name__}, got {value!r}") from None
    if kind is float and not math.isfinite(number):
        raise InvalidRequest(f"sampling_parameters.{name} must be finite, got {value!r}")
    return number


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidRequest(f"sampling_parameters.{name} must be in [{low}, {high}], got {value}")


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1"):
        return True
    if str(value).lower() in ("false", "0"):
        return False
    raise InvalidRequest(f"sampling_parameters.{name} must be a boolean, got {value!r}")


def _stop_strings(value: Any) -> list[str]:
    """vLLM's "stop": a string or a list of strings (null: none)."""
    strings = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise InvalidRequest(f"sampling_parameters.stop must be a string or a list of strings, got {value!r:.80}")
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling_parameters.stop has {len(strings)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in strings:
        if not 1 <= len(s) <= MAX_STOP_LENGTH:
            raise InvalidRequest(f"sampling_parameters.stop strings must have 1 to {MAX_STOP_LENGTH} characters, "
                                 f"got {len(s)} ({s!r:.40})")
    return strings


def sampling_params_from_dict(values: dict[str, Any], config: EngineConfig) -> SamplingParams:
    """Validate a sampling_parameters dict against the deployment limits."""
    if not isinstance(values, dict):
        raise InvalidRequest(f"sampling_parameters must be a JSON object, got {type(values).__name__}")
    params = SamplingParams(max_tokens=config.default_max_tokens, mode=config.default_mode,
                            tree_budget=config.default_tree_budget, seed=None,
                            stream_interval=config.default_stream_interval)
    for key, value in values.items():
        if key == "max_tokens":
            params.max_tokens = _number(key, value, int)
            _check_range(key, params.max_tokens, 1, config.max_tokens_limit)
        elif key == "temperature":
            params.temperature = _number(key, value, float)
            _check_range(key, params.temperature, 0.0, 100.0)
        elif key == "top_p":
            params.top_p = _number(key, value, float)
            if not 0.0 < params.top_p <= 1.0:
                raise InvalidRequest(f"sampling_parameters.top_p must be in (0, 1], got {params.top_p}")
        elif key == "top_k":
            params.top_k = _number(key, value, int)
            if params.top_k < -1:
                raise InvalidRequest(f"sampling_parameters.top_k must be -1, 0 or positive, got {params.top_k}")
            params.top_k = max(params.top_k, 0)
        elif key == "seed":
            params.seed = None if value is None else _number(key, value, int)
            if params.seed is not None:
                _check_range(key, params.seed, 0, 2**63 - 1)
        elif key == "min_tokens":
            params.min_tokens = _number(key, value, int)
            _check_range(key, params.min_tokens, 0, config.max_tokens_limit)
        elif key == "ignore_eos":
            params.ignore_eos = _bool(key, value)
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise InvalidRequest(f"sampling_parameters.stop_token_ids must be a list of integers, got {value!r}")
            params.stop_token_ids = list(value)
        elif key == "stop":
            params.stop = _stop_strings(value)
        elif key in ("mode", "decoding_mode"):
            if value not in MODES:
                raise InvalidRequest(f"sampling_parameters.{key} must be one of {list(MODES)}, got {value!r}")
            params.mode = value
        elif key in ("tree_budget", "budget"):
            params.tree_budget = _number(key, value, int)
            _check_range(key, params.tree_budget, 1, config.max_tree_budget)
        elif key == "stream_interval":
            params.stream_interval = _number(key, value, int)
            _check_range(key, params.stream_interval, 1, MAX_STREAM_INTERVAL)
        elif key in _ACCEPTED_NOOP:
            if value is not None and value != _ACCEPTED_NOOP[key] and str(value) != str(_ACCEPTED_NOOP[key]):
                raise InvalidRequest(
                    f"sampling_parameters.{key}={value!r} is not supported (only {_ACCEPTED_NOOP[key]!r})")
        else:
            raise InvalidRequest(f"sampling_parameters has unknown key {key!r}")
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(
            f"sampling_parameters.min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})")
    if params.mode != "ar" and not config.drafter_path:
        raise InvalidRequest(f"mode {params.mode!r} needs a drafter; this deployment serves only 'ar'")
    return params
