"""Per-request state and the record each decoding round hands to the serving edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddtree.sampling_params import SamplingParams


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)   # tokens committed per round (add_round)
    finish_reason: str | None = None
    accepted_total: int = 0            # sum(acceptance_lengths), kept as they are added: read every round
    # time.perf_counter() at the start and the end of the engine's prefill that admitted it (with whatever else that
    # step admitted): where its time to first token went (ddtree_request_queue_seconds, ..._prefill_seconds)
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0

    def add_round(self, accepted_length: int) -> None:
        self.acceptance_lengths.append(accepted_length)
        self.accepted_total += accepted_length

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def mean_acceptance_length(self) -> float:
        rounds = len(self.acceptance_lengths)
        return self.accepted_total / rounds if rounds else 0.0


@dataclass(slots=True)
class RequestOutput:
    """What one round produced for one request."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None          # None while running, then "stop" or "length"
    num_input_tokens: int
    num_output_tokens: int             # cumulative
    num_rounds: int
    mean_acceptance_length: float

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
