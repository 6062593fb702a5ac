"""DDTree speculative decoding engine: DFlash drafter + tree verification, served by Triton."""

from ddtree.config import EngineConfig
from ddtree.errors import EngineUnavailable, InvalidRequest
from ddtree.sampling_params import SamplingParams

__all__ = ["EngineConfig", "EngineUnavailable", "InvalidRequest", "SamplingParams"]
__version__ = "0.1.0"
