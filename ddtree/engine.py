"""Engine: one request at a time through draft -> build -> compile -> verify -> accept -> commit."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ddtree.config import EngineConfig
from ddtree.errors import InvalidRequest
from ddtree.models.dense import DenseTarget
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.loader import dtype_of
from ddtree.models.target import load_target
from ddtree.request import Request, RequestOutput
from ddtree.sampling import probabilities, sample, suppress_tokens
from ddtree.sampling_params import SamplingParams
from ddtree.tree import DraftTree, build_chain, build_tree, compile_tree, top_log_probs
from ddtree.tree.build import _empty_tree
from ddtree.verify import accept

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StageTimes:
    """Wall time per stage in seconds, summed over rounds (synchronized on GPU)."""
    prefill: float = 0.0
    draft: float = 0.0
    tree_build: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    rounds: int = 0
    acceptance_histogram: dict[int, int] = field(default_factory=dict)


class Engine:
    """Owns the target, the drafter, their caches and the decoding loop."""

    def __init__(self, config: EngineConfig, target: DenseTarget | None = None,
                 drafter: DFlashDrafter | None = None) -> None:
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        dtype, device = dtype_of(config.dtype), torch.device(config.device)
        self.device = device
        self.target = target or load_target(config.target_path, dtype, config.device)
        if drafter is None and config.drafter_path:
            drafter = DFlashDrafter.from_pretrained(config.drafter_path, dtype, config.device)
        self.drafter = drafter
        self.tap_layers = list(drafter.config.target_layer_ids) if drafter else []
        if drafter is not None:
            num_target_layers = self.target.config.num_hidden_layers
            if max(self.tap_layers) >= num_target_layers:
                raise ValueError(f"drafter taps {self.tap_layers} but the target has {num_target_layers} layers")
            if drafter.config.hidden_size != self.target.config.hidden_size:
                raise ValueError("drafter hidden_size differs from the target's")
        cache_len = config.max_model_len + config.max_tree_budget + 1
        self.cache = self.target.new_cache(cache_len)
        self.draft_cache = drafter.new_cache(cache_len) if drafter else None
        self.stage_times = StageTimes()
        self._num_requests = 0

    # -- request checks ---------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequest("prompt is empty after tokenization")
        if len(prompt_ids) >= self.config.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; it must be shorter than the context "
                f"max_model_len={self.config.max_model_len}")
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab}), got {bad[:4]}")

    def stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids.update(self.target.eos_token_ids)
        return ids

    # -- decoding ---------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, request: Request) -> Iterator[RequestOutput]:
        """Yield one RequestOutput per round until the request finishes."""
        self.check_prompt(request.prompt_ids)
        params = request.params
        if params.mode != "ar" and self.drafter is None:
            raise InvalidRequest(f"mode {params.mode!r} needs a drafter; this deployment serves only 'ar'")
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self.config.seed + self._num_requests
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self._num_requests += 1
        max_tokens = min(params.max_tokens, self.config.max_model_len - len(request.prompt_ids))
        stop_ids = self.stop_ids(params)
        suppressed = sorted(self.target.eos_token_ids) if params.min_tokens else []

        prompt = torch.tensor(request.prompt_ids, dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        n = prompt.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        logits, taps = self.target(prompt, torch.arange(n, device=self.device), self.cache, 0, causal,
                                   self.tap_layers, logit_rows=torch.tensor([n - 1], device=self.device))
        logits = suppress_tokens(logits, suppressed, torch.tensor([params.min_tokens > 0], device=self.device))
        first = self._choose(logits[0], params, generator)
        self.cache.compact(0, list(range(n)))   # the prompt is committed whole (hybrid targets commit recurrent state here)
        self._sync()
        self.stage_times.prefill += time.perf_counter() - t0
        if self.draft_cache is not None:
            self.draft_cache.length = 0
        pending_taps, start, root = taps, n, first
        yield self._commit(request, [first], stop_ids, max_tokens, accepted_length=None)

        while request.finish_reason is None:
            tree = self._draft(request, params, root, start, pending_taps, max_tokens)
            t_verify = time.perf_counter()
            batch = compile_tree(tree, root, start)
            logits, taps = self.target(batch.input_ids.to(self.device), batch.positions.to(self.device),
                                       self.cache, start, batch.visibility.to(self.device), self.tap_layers)
            if suppressed:
                depth = torch.tensor(tree.depths, device=self.device)
                logits = suppress_tokens(logits, suppressed, request.num_output_tokens + depth < params.min_tokens)
            acceptance = accept(tree, logits, params, generator)
            self._sync()
            t_commit = time.perf_counter()
            self.stage_times.verify += t_commit - t_verify
            self.cache.compact(start, acceptance.accepted)
            rows = torch.tensor(acceptance.accepted, device=self.device)
            pending_taps = taps[rows] if taps is not None else None
            new_tokens = [tree.tokens[i] for i in acceptance.accepted[1:]] + [acceptance.bonus_token]
            start += len(acceptance.accepted)
            root = acceptance.bonus_token
            output = self._commit(request, new_tokens, stop_ids, max_tokens, len(acceptance.accepted))
            self.stage_times.commit += time.perf_counter() - t_commit
            yield output

    def _draft(self, request: Request, params: SamplingParams, root: int, start: int,
               pending_taps: torch.Tensor | None, max_tokens: int) -> DraftTree:
        """Draft one block and build this round's tree (empty in `ar` mode)."""
        # The bonus token always adds one, so deeper drafts than this can never be used.
        depth_limit = max_tokens - request.num_output_tokens - 1
        if params.mode == "ar" or depth_limit <= 0:
            return _empty_tree()
        t0 = time.perf_counter()
        drafter, cache = self.drafter, self.draft_cache
        positions = torch.arange(cache.length, start, device=self.device)
        drafter.add_context(cache, pending_taps, positions)
        block = torch.full((drafter.block_size,), drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[0] = root
        hidden = drafter(cache, self.target.embed(block), start)
        draft_logits = self.draft_logits(hidden[1 : 1 + depth_limit])   # [depth, vocab]
        t1 = time.perf_counter()
        if params.mode == "dflash":
            tree = build_chain(draft_logits.argmax(dim=-1).tolist())
        else:
            log_probs, token_ids = top_log_probs(draft_logits, params.tree_budget)
            tree = build_tree(log_probs, token_ids, params.tree_budget)
        t2 = time.perf_counter()
        self.stage_times.draft += t1 - t0
        self.stage_times.tree_build += t2 - t1
        return tree

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter outputs -> logits through the target's lm_head; hidden  # [depth, hidden]"""
        return self.target.logits(hidden)

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        if params.is_greedy:
            return int(logits.argmax().item())
        return sample(probabilities(logits[None], params)[0], generator)

    def _commit(self, request: Request, new_tokens: list[int], stop_ids: set[int], max_tokens: int,
                accepted_length: int | None) -> RequestOutput:
        """Append this round's tokens, cut at a stop token or max_tokens, and report them."""
        room = max_tokens - request.num_output_tokens
        kept = new_tokens[:room]
        for i, token in enumerate(kept):
            if token in stop_ids:
                kept = kept[: i + 1]
                request.finish_reason = "stop"
                break
        request.output_ids.extend(kept)
        if request.finish_reason is None and request.num_output_tokens >= max_tokens:
            request.finish_reason = "length"
        if accepted_length is not None:
            request.acceptance_lengths.append(accepted_length)
            self.stage_times.rounds += 1
            hist = self.stage_times.acceptance_histogram
            hist[accepted_length] = hist.get(accepted_length, 0) + 1
        return RequestOutput(
            request_id=request.request_id, new_token_ids=kept, finish_reason=request.finish_reason,
            num_input_tokens=len(request.prompt_ids), num_output_tokens=request.num_output_tokens,
            num_rounds=len(request.acceptance_lengths), mean_acceptance_length=request.mean_acceptance_length,
        )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "local") -> Request:
        """Run a request to completion in process (tests, benchmarks)."""
        request = Request(request_id=request_id, prompt_ids=list(prompt_ids), params=params)
        for _ in self.generate(request):
            pass
        return request
