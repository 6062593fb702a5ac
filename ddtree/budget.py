"""Budget policy: per round, how many draft nodes each request gets, so that a round pays.

Every request's best-first tree is built at the largest allowed budget; its nodes come in
decreasing draft weight w (the product of the draft marginals along the node's path), and the
best tree of budget b is its first b nodes. Under the drafter's own surrogate a node is accepted
with probability w, so a request whose tree keeps its first b nodes expects 1 + sum of their w
tokens. The policy merges all requests' nodes by weight and keeps the top K overall, choosing K
to maximise expected tokens per second of the round under a measured cost model of the verify
pass (time against total nodes in the batch). K = 0 is plain decoding for everyone: trees are
kept only where the cost model says they pay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA = Path(__file__).with_name("data")
DEFAULT_COST_MODEL = DATA / "cost_model_cpu.json"


def default_cost_model(device: str) -> Path:
    """The measured cost model for the device kind: H200 data on CUDA devices, CPU data otherwise."""
    return DATA / "cost_model_h200.json" if str(device).startswith("cuda") else DEFAULT_COST_MODEL


@dataclass(frozen=True, slots=True)
class CostModel:
    """Verify time in ms as a piecewise-linear function of the number of query rows in the batch."""
    rows: tuple[int, ...]          # increasing
    verify_ms: tuple[float, ...]
    draft_ms: float                # one packed drafter pass (paid whenever any request drafts)
    source: str = ""

    @classmethod
    def load(cls, path: str | Path = DEFAULT_COST_MODEL) -> "CostModel":
        data = json.loads(Path(path).read_text())
        points = sorted(zip(data["rows"], data["verify_ms"]))
        return cls(rows=tuple(r for r, _ in points), verify_ms=tuple(t for _, t in points),
                   draft_ms=float(data["draft_ms"]), source=data.get("source", str(path)))

    def verify(self, rows: int) -> float:
        return float(np.interp(rows, self.rows, self.verify_ms))


def node_weights(log_weights: list[float]) -> np.ndarray:
    """w per node (pop order) from the tree builder's log-weights."""
    return np.exp(np.asarray(log_weights, dtype=np.float64))


def choose_budgets(weights: list[np.ndarray], cost: CostModel, max_budgets: list[int],
                   fixed_rows: int = 0) -> list[int]:
    """Per-request node counts maximising expected tokens per ms of the round.

    weights[i]  # node weights of request i's full tree, non-increasing; max_budgets[i] caps it.
    fixed_rows: rows of other requests in the same verify pass (not chosen here).
    """
    num_requests = len(weights)
    pool = [(float(w), i) for i, ws in enumerate(weights) for w in ws[: max_budgets[i]]]
    pool.sort(key=lambda item: -item[0])
    base_rows = fixed_rows + num_requests
    best_k, best_rate = 0, num_requests / cost.verify(base_rows)     # no tree at all
    expected = float(num_requests)
    for k, (w, _) in enumerate(pool, start=1):
        expected += w
        rate = expected / (cost.draft_ms + cost.verify(base_rows + k))
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    budgets = [0] * num_requests
    for _, i in pool[:best_k]:
        budgets[i] += 1
    return budgets


def expected_tokens(weights: np.ndarray, budget: int) -> float:
    return 1.0 + float(np.sum(weights[:budget])) if budget > 0 else 1.0
