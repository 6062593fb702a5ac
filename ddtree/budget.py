"""Budget policy: per round, how many draft nodes each request gets, so that a round pays.

Every request's best-first tree is built at the largest allowed budget; its nodes come in
decreasing draft weight w (the product of the draft marginals along the node's path), and the
best tree of budget b is its first b nodes. Under the drafter's own surrogate a node is accepted
with probability w, so a request whose tree keeps its first b nodes expects 1 + sum of their w
tokens. The policy merges all requests' nodes by weight and keeps the top K overall, choosing K
to maximise expected tokens per second of the round under a measured cost model of the verify
pass (time against total nodes in the batch). K = 0 is plain decoding for everyone: trees are
kept only where the cost model says they pay.

The cost model is offline data and the surrogate is the drafter's belief, so on its own the policy
can lose to a fixed method on a given machine and load (it did: 0.72x of `ar` at 16 streams on 2
CPU cores, 0.83x of `ddtree-16` at 4 streams on the H200). `ArmSelector` closes that gap with
measurements: per batch-size bucket it treats `ar`, `dflash`, `ddtree` at a few fixed budgets and
the policy as arms, tries each a few rounds, then runs the one with the highest measured committed
tokens per second of wall time (a round is charged from the previous round's end: the serving loop's work
per round counts too, Engine._cycle_start) (plus a small optimism bonus for arms measured in few rounds, so
that an unlucky estimate of a close competitor gets corrected), re-probing the others every so often.
An arm whose rounds take s times as long as the best arm's is re-probed after REPROBE_EVERY * s
rounds, a wait that doubles after every probe it does not win (up to 2**MAX_BACKOFF): each arm costs
at most 1/REPROBE_EVERY of the time once explored, and a clearly losing arm's share goes to 0.
Exploration carries over between batch sizes (ArmSelector._pruned).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

logger = logging.getLogger(__name__)

DATA = Path(__file__).with_name("data")
DEFAULT_COST_MODEL = DATA / "cost_model_cpu.json"


def default_cost_model(device: str, hidden_size: int | None = None, num_layers: int | None = None) -> Path:
    """The measured cost model for the device kind and target: on CUDA devices H200 data for a target of these
    dimensions where the project measured one (cost_model_h200_<hidden>x<layers>.json: Qwen3.6-27B, Qwen3-8B, by
    perf/gpu_ratios.py), else the embedded default's H200 data; CPU data otherwise."""
    if not str(device).startswith("cuda"):
        return DEFAULT_COST_MODEL
    shaped = DATA / f"cost_model_h200_{hidden_size}x{num_layers}.json"
    return shaped if shaped.is_file() else DATA / "cost_model_h200.json"


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
        """Interpolated between measured points; past the last one, extended along the last segment's slope (never
        flat: a tree larger than the data must not look as cheap as the largest measured one)."""
        return float(self.verify_many(np.array([rows]))[0])

    def verify_many(self, rows: np.ndarray) -> np.ndarray:
        """verify() of every element of rows, in one numpy pass."""
        out = np.interp(rows, self.rows, self.verify_ms)
        if len(self.rows) > 1:
            slope = max((self.verify_ms[-1] - self.verify_ms[-2]) / (self.rows[-1] - self.rows[-2]), 0.0)
            beyond = rows > self.rows[-1]
            out[beyond] = self.verify_ms[-1] + slope * (rows[beyond] - self.rows[-1])
        return out


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
    # every request's nodes in one pool, best first (ties: request order, then node order): at 32 requests of
    # 64-node trees a pool of 2048, whose rates numpy computes at once (a Python loop with an interpolation per
    # node took ~3.5 ms a round)
    parts = [np.asarray(ws[: max_budgets[i]], dtype=np.float64) for i, ws in enumerate(weights)]
    pool = np.concatenate(parts) if parts else np.zeros(0)
    owner = np.repeat(np.arange(num_requests), [len(part) for part in parts])
    order = np.argsort(-pool, kind="stable")
    base_rows = fixed_rows + num_requests
    best_k, best_rate = 0, num_requests / cost.verify(base_rows)     # no tree at all
    expected = num_requests + np.cumsum(pool[order])                 # expected tokens with the k best nodes
    rates = expected / (cost.draft_ms + cost.verify_many(base_rows + np.arange(1, len(pool) + 1)))
    for k, rate in enumerate(rates.tolist(), start=1):               # the first k that beats every smaller one
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return np.bincount(owner[order[:best_k]], minlength=num_requests).tolist()


def expected_tokens(weights: np.ndarray, budget: int) -> float:
    return 1.0 + float(np.sum(weights[:budget])) if budget > 0 else 1.0


# -- measured selection among methods --------------------------------------------------------

DEFAULT_ARMS = "ar,dflash,ddtree-4,ddtree-8,ddtree-16,ddtree-32,ddtree-64,policy"
MIN_SAMPLES = 2          # rounds each arm is tried before its estimate is trusted
REPROBE_EVERY = 256      # then an arm is tried again after this many rounds x its probe's time / the best arm's round
DECAY = 0.9              # weight of an arm's past rounds against its newest one
PRUNE = 0.8              # a tree below this fraction of a lighter arm (fewer draft nodes) rules out larger trees
PRUNE_ACROSS = 0.95      # an arm below this fraction of a lighter arm at a smaller batch is not tried at larger ones
UCB = 0.2                # optimism bonus of an arm measured in n rounds: rate x (1 + UCB / sqrt(n))
PRUNE_EVERY = 8          # rounds of a bucket between recomputations of the arms it rules out
LOG_AFTER = 16           # a bucket's new leading arm is logged once it has led this many choices in a row
MAX_BACKOFF = 5          # a re-probe that does not win doubles the arm's re-probe interval, up to 2**MAX_BACKOFF x
MAX_GAP = 4.0            # an arm measured at 1/g of the leader's rate waits up to g x longer between re-probes
SETTLED_FOR = 64         # rounds a bucket's settled choice (the leader, no probe due) is reused before it is recomputed
TRANSIENT = 64           # rounds a batch size below the largest of these rounds counts as passing (see choose)
IDLE_EXPLORED = 4        # policy rounds of a bucket in which nobody drafted that count as its exploration there
STALL = 1.5              # a measured round counts at most this many times its arm's mean round (a stall is not the arm's)
LEAD_MARGIN = 0.05       # the leading arm keeps the lead until another one scores this fraction above it


class Arm(NamedTuple):
    """What `auto` requests do in one round: mode "ar" (no draft), "dflash" (chain), "ddtree" with `budget`
    (capped by each request's tree_budget), or "policy" (the cost-model policy above). A named tuple: the selector
    keys its statistics by (bucket, arm) and looks them up ~100 times a round, where a dataclass's generated Python
    __hash__ cost ~25 us per round (a tuple hashes and compares in C)."""
    mode: str
    budget: int = 0

    @property
    def name(self) -> str:
        return f"ddtree-{self.budget}" if self.mode == "ddtree" else self.mode

    @classmethod
    def parse(cls, name: str) -> "Arm":
        name = name.strip()
        if name in ("ar", "dflash", "policy"):
            return cls(name)
        if name.startswith("ddtree-") and name[7:].isdigit() and int(name[7:]) > 0:
            return cls("ddtree", int(name[7:]))
        raise ValueError(f"unknown auto arm {name!r}: use ar, dflash, policy or ddtree-<budget>")


AR = Arm("ar")


def parse_arms(spec: str) -> tuple[Arm, ...]:
    arms = tuple(dict.fromkeys(Arm.parse(n) for n in spec.split(",") if n.strip()))
    if not arms:
        raise ValueError("auto_arms is empty")
    return arms


class ArmSelector:
    """Per batch-size bucket (1, 2, 3-4, 5-8, ...): decayed sums of committed tokens per running request and of round
    seconds, per arm. Per request: a bucket spans batch sizes up to 2x apart, and `ar`, always measured now, would be
    judged at the batch size of the moment against arms measured at another (as a batch drains from 16 to 9 requests
    `ar`'s tokens a round fall by 44%, its round time by far less, and a drafting arm's estimate from 16 requests would
    lead); per request, the arms' rates move together with the batch size, by the round time alone."""

    def __init__(self, arms: tuple[Arm, ...], min_samples: int = MIN_SAMPLES, reprobe_every: int = REPROBE_EVERY,
                 decay: float = DECAY, chain_nodes: int = 15) -> None:
        self.arms, self.min_samples, self.reprobe_every, self.decay = arms, min_samples, reprobe_every, decay
        self.chain_nodes = chain_nodes            # draft nodes of a dflash round (block size - 1)
        self.settled: dict[int, set[Arm]] = {}    # bucket -> arms it pruned, once every other arm was explored
        self.tokens: dict[tuple[int, Arm], float] = defaultdict(float)
        self.seconds: dict[tuple[int, Arm], float] = defaultdict(float)
        self.weight: dict[tuple[int, Arm], float] = defaultdict(float)     # decayed number of rounds
        self.samples: dict[tuple[int, Arm], int] = defaultdict(int)
        self.last_tried: dict[tuple[int, Arm], int] = defaultdict(lambda: -1)
        self.misses: dict[tuple[int, Arm], int] = defaultdict(int)        # re-probes since the arm last led
        self.idle: dict[tuple[int, Arm], int] = defaultdict(int)          # the policy's rounds in which nobody drafted
        self.probing: dict[int, tuple[Arm, float]] = {}                   # bucket -> (arm re-probed, best's rate)
        self.rounds: dict[int, int] = defaultdict(int)
        self.catch_up: dict[tuple[int, Arm], float] = defaultdict(float)   # seconds of the arm's last catch-up round
        # (bucket, arms) -> (round to recompute at, pruned, the arms left, whether each of those was explored)
        self._eligible: dict[tuple, tuple[int, set[Arm], tuple[Arm, ...], bool]] = {}
        self._capped: dict[tuple, tuple[Arm, ...]] = {}            # (max_budget, chain) -> the arms choose considers
        self.leader: dict[int, tuple[Arm, int, bool]] = {}          # bucket -> (leading arm, since round, logged)
        # bucket -> (eligible arms, round it holds until, leader, the others' best score): see choose
        self._settled_choice: dict[int, tuple[tuple[Arm, ...], int, Arm, float]] = {}
        self._version: dict[int, int] = defaultdict(int)             # bucket -> rounds recorded (caches below)
        self._lost: dict[tuple, tuple[int, set[Arm]]] = {}          # (bucket, arms, margin) -> (version, lost)
        self.last: Arm | None = None                # the last round's arm (any batch size)
        # this round's arm drafts after rounds that did not (a catch-up), or is `ar` after drafting rounds (a re-entry)
        self.catching_up = False
        self.repeat: tuple[int, Arm] | None = None  # (bucket, arm) to run again, measured, after a catch-up round
        self.total = 0                  # rounds of every bucket
        self.peak = (0, 0)              # (the largest bucket of the last TRANSIENT rounds, the round it was last seen)

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return max(1, num_seqs - 1).bit_length() if num_seqs > 1 else 0

    def rate(self, bucket: int, arm: Arm) -> float:
        """Measured committed tokens per second per running request (0 before any sample)."""
        seconds = self.seconds[(bucket, arm)]
        return self.tokens[(bucket, arm)] / seconds if seconds > 0 else 0.0

    def draft_nodes(self, arm: Arm) -> int:
        """Draft nodes an arm verifies per request and round (its weight against the batch's verify)."""
        return {"ar": 0, "dflash": self.chain_nodes}.get(arm.mode, arm.budget)

    def _pruned(self, b: int, arms: tuple[Arm, ...]) -> set[Arm]:
        """Arms not worth trying in bucket b: trees larger than an explored tree that already loses clearly
        here (more nodes will not pay either, and they cost the slowest rounds), i.e. below PRUNE x an arm that
        drafts fewer nodes; and, from every smaller batch size whose exploration is done, the arms it pruned and
        those it measured below PRUNE_ACROSS x an arm that drafts fewer nodes (drafting pays less as the batch
        grows: the verify of more rows costs more, and the drafter's pass fills fewer idle cycles; so what lost to
        lighter drafting at a smaller batch loses at a larger one). The policy arm drafts too: it is pruned across
        batch sizes like the fixed arms, below PRUNE_ACROSS x `ar` (through Triton at c=32 on the H200 its probes, rounds
        of ~10 ms against `ar`'s 1.8, took 2% of `auto`'s time: concurrency_h200_deferred.md). ar is never pruned."""
        pruned: set[Arm] = set()
        for smaller in range(b):
            if smaller in self.settled:
                pruned |= self.settled[smaller] | self._lost_since(smaller, arms, PRUNE_ACROSS)
        losing = [a.budget for a in self._lost_to_lighter(b, arms, PRUNE) if a.mode == "ddtree"]
        pruned |= {a for a in arms if a.mode == "ddtree" and losing and a.budget > min(losing)}
        return {a for a in pruned if a.mode != "ar"}

    def _lost_since(self, b: int, arms: tuple[Arm, ...], margin: float) -> set[Arm]:
        """_lost_to_lighter of a smaller batch size, kept until a round of it is recorded (while the batch is larger,
        none is: computed once, not every PRUNE_EVERY rounds for each smaller size, O(arms^2) each)."""
        key = (b, arms, margin)
        version, lost = self._lost.get(key, (-1, set()))
        if version != self._version[b]:
            lost = self._lost_to_lighter(b, arms, margin)
            self._lost[key] = (self._version[b], lost)
        return lost

    def _lost_to_lighter(self, b: int, arms: tuple[Arm, ...], margin: float) -> set[Arm]:
        """Arms explored in bucket b measured below margin x an explored arm that drafts fewer nodes (losing to a
        heavier arm says nothing: a larger tree may pay more still)."""
        explored = [a for a in arms if self.samples[(b, a)] >= self.min_samples]
        lost = set()
        for a in explored:
            if a.mode == "policy":   # its trees vary round by round: what it must beat is not drafting at all
                lighter = [self.rate(b, o) for o in explored if o.mode == "ar"]
            else:
                lighter = [self.rate(b, o) for o in explored if o.mode != "policy"
                           and self.draft_nodes(o) < self.draft_nodes(a)]
            if lighter and self.rate(b, a) < margin * max(lighter):
                lost.add(a)
        return lost

    def explored(self, bucket: int, arm: Arm) -> bool:
        """Whether the arm's estimate in this bucket is trusted: min_samples rounds measured; for the policy arm also
        IDLE_EXPLORED rounds in which it drafted for nobody. Those are credited to `ar` (record), so a policy whose
        back-off skips drafting (up to 64 rounds a request) never gathers samples: counted unexplored, it was chosen in
        every round of the bucket, each a plain step without `ar`'s lookahead (on the H200 in the drains of batches
        of 16-32 requests, policy in all 10 rounds at 3-4 requests: admission_probe_h200_catchup.md)."""
        key = (bucket, arm)
        return self.samples[key] >= self.min_samples or self.idle[key] >= IDLE_EXPLORED

    def score(self, bucket: int, arm: Arm) -> float:
        """The measured rate plus an optimism bonus that shrinks with the arm's (decayed) number of rounds: an arm
        whose few rounds came out unluckily low, but that is close to the best, gets tried again soon (UCB). An arm
        never measured scores infinite, unless explored without drafting (a policy that found no tree worth it: 0,
        re-probed on the schedule of a losing arm)."""
        weight = self.weight[(bucket, arm)]
        if weight > 0:
            return self.rate(bucket, arm) * (1.0 + UCB / weight**0.5)
        return 0.0 if self.explored(bucket, arm) else float("inf")   # explored unmeasured: only by idle rounds

    def round_seconds(self, bucket: int, arm: Arm) -> float:
        """Measured seconds of one round of this arm (decayed mean)."""
        weight = self.weight[(bucket, arm)]
        return self.seconds[(bucket, arm)] / weight if weight > 0 else 0.0

    def choose(self, num_seqs: int, max_budget: int | None = None, chain: bool = True) -> Arm:
        """This round's arm for `num_seqs` running requests; ddtree arms above max_budget (the auto requests'
        largest tree_budget: they would build the same trees as smaller ones; or the largest trees a verify program
        made takes) are left out, and with chain=False the dflash arm (no program made takes its chains)."""
        b = self.bucket(num_seqs)
        self.total += 1
        peak, seen = self.peak
        passing = b < peak and self.total - seen <= TRANSIENT
        if not passing:
            self.peak = (b, self.total)
        repeat, self.repeat = self.repeat, None
        if repeat is not None and repeat[0] == b:   # the measured round of an arm whose last round caught up
            self._settled_choice.pop(b, None)
            self.rounds[b] += 1
            self.last_tried[repeat] = self.rounds[b]
            self.last = repeat[1]
            return repeat[1]
        arms = self._capped.get((max_budget, chain))
        if arms is None:
            arms = tuple(a for a in self.arms if (a.mode != "ddtree" or max_budget is None or a.budget <= max_budget)
                         and (chain or a.mode != "dflash"))
            arms = self._capped[(max_budget, chain)] = arms or self.arms
        if passing and self.last in arms:
            # a batch size passed through, below the largest of the last TRANSIENT rounds: the drain and refill between
            # waves of requests (through Triton at 16 streams, each wave's 16 requests end within a few rounds and the
            # next arrive over a few more: rounds of 1-5 requests among rounds of 12-16). Its rounds keep the last
            # arm, measured, but do not explore or re-probe there: on the H100 they explored every drafting arm at 1-3
            # requests, one catch-up (up to 145 ms) after another: 0.8% of the rounds and 6.8% of the time of a warm-up and turn
            # (concurrency_h100_perrequest_high.md, auto_trace_h100_perrequest_c16.md). A batch size that lasts
            # (the load fell) is explored once TRANSIENT rounds pass without the larger one
            self.rounds[b] += 1
            self.last_tried[(b, self.last)] = self.rounds[b]
            self.catching_up = False
            return self.last
        cached = self._eligible.get((b, arms))
        if cached is None or self.rounds[b] >= cached[0] or not cached[3]:
            # once exploration is done, which arms are ruled out changes slowly (it compares decayed rates): it is
            # recomputed every PRUNE_EVERY rounds of the bucket, not every round (O(buckets x arms^2) of Python);
            # while an eligible arm is unexplored, every round (samples only grow: explored stays explored)
            pruned = self._pruned(b, arms)
            eligible = tuple(a for a in arms if a not in pruned) or arms
            if cached is not None and cached[2] == eligible:
                eligible = cached[2]   # the same object: a settled choice made with it still holds
            explored = all(self.explored(b, a) for a in eligible)
            cached = self._eligible[(b, arms)] = (self.rounds[b] + PRUNE_EVERY, pruned, eligible, explored)
        _, pruned, arms, explored = cached
        self.rounds[b] += 1
        unexplored = [] if explored else [a for a in arms if not self.explored(b, a)]
        settled = self._settled_choice.get(b)
        if unexplored:
            arm = unexplored[0]
        elif (settled is not None and settled[0] is arms and self.rounds[b] < settled[1]
              and self._holds(b, settled[2], settled[3])):
            # the last choice still holds: the same eligible arms, its arm still leads (the others' scores change only
            # when they are recorded, which drops this), and no re-probe falls due before settled[1]. The common
            # round, made O(1): the full choice and its record took 7-15 us a round on the 2-core CPU, part of what
            # `auto` settled on `ar` costs over `ar` (perf/results/round_profile_h200_55928a8.md)
            arm = settled[2]
        else:
            self.settled.setdefault(b, pruned)
            best = max(arms, key=lambda a: self.score(b, a))
            held = self.leader.get(b, (None,))[0]
            if held is not None and held != best and held in arms and self._holds(b, held, self.score(b, best)):
                best = held   # within LEAD_MARGIN: estimates that swap on noise would switch arms, and each switch costs
            self._log_leader(b, best, arms)
            # an interval is at least reprobe_every rounds; an arm is due once that many rounds passed since it ran
            wait = {a: max(self.reprobe_every, self.reprobe_interval(b, a, best)) for a in arms if a != best}
            due = [a for a, w in wait.items() if self.rounds[b] - self.last_tried[(b, a)] >= w]
            arm = min(due, key=lambda a: self.last_tried[(b, a)]) if due else best
            if arm == best:
                self.misses[(b, arm)] = 0
                # held until the first re-probe falls due, or SETTLED_FOR rounds (the leader's measures drift, and
                # the intervals with them)
                until = min([self.last_tried[(b, a)] + w for a, w in wait.items()] + [self.rounds[b] + SETTLED_FOR])
                others = max((self.score(b, a) for a in wait), default=float("-inf"))
                self._settled_choice[b] = (arms, until, best, others)
            else:   # counted as lost until the arm leads again: the next re-probe waits twice as long
                self.misses[(b, arm)] = min(self.misses[(b, arm)] + 1, MAX_BACKOFF)
                self.probing[b] = (arm, self.rate(b, best))
                self._settled_choice.pop(b, None)
        self.last_tried[(b, arm)] = self.rounds[b]
        # the drafter has not seen the features of the tokens committed while nobody drafted: the first drafting round
        # after them ingests them all (a catch-up that steady drafting never pays), so it is not the arm's measure; and
        # the first `ar` round after drafting rounds is not `ar`'s (its queued next step, the lookahead, starts again,
        # and it waits for the drafting round's deferred device work): measured, `ar` probed among drafting rounds was
        # judged by that round alone, its estimate held down by it while a drafting arm led
        drafts, drafted = arm.mode != "ar", self.last is not None and self.last.mode != "ar"
        self.catching_up = drafts != drafted if self.last is not None else drafts
        self.last = arm
        return arm

    def _holds(self, b: int, leader: Arm, others: float) -> bool:
        """Whether the leading arm keeps the lead against the others' best score: unless that is LEAD_MARGIN above its
        own. Switching between `ar` and a drafting arm costs a catch-up or re-entry round each way (3-18 ms at one
        stream on the H100, against `ar`'s 0.9 ms), and each new leader re-times the re-probes of the others: on the
        H100 in process a `ddtree-4` estimate 2% below `ar`'s (984 against 1050 tok/s, from 12 rounds of one prompt)
        took the lead after a slow `ar` round, and its re-probes of dflash, ddtree-8 and policy that followed cost
        10% of the pass (auto_trace_h100_reentry.md, pass 2)."""
        return self.score(b, leader) * (1.0 + LEAD_MARGIN) >= others

    def _log_leader(self, b: int, best: Arm, arms: tuple[Arm, ...]) -> None:
        """Log when a batch size's leading arm changes and holds the lead for LOG_AFTER choices (arms of near-equal
        rates can swap the lead round by round: those swaps are not logged)."""
        arm, since, logged = self.leader.get(b, (None, 0, True))
        if best != arm:
            self.leader[b] = (best, self.rounds[b], False)
        elif not logged and self.rounds[b] - since >= LOG_AFTER:
            self.leader[b] = (arm, since, True)
            logger.info("auto: batch size %s runs %s (score: measured tokens/s a request, the less measured the more optimistic; "
                        "%s)", self.label(b), arm.name, ", ".join(f"{a.name} {self.rate(b, a):.1f}" for a in arms))

    def reprobe_interval(self, bucket: int, arm: Arm, best: Arm) -> float:
        """Rounds between re-probes of a non-leading arm: reprobe_every x the probe's time / the best arm's round
        (so each re-probe costs the same share of the time) x its gap to the leader's rate (`gap`: the further below,
        the less likely a probe finds it ahead), doubled for every re-probe since it last led (a
        clearly losing arm's probes fade out: their share of the time goes to 0 instead of staying at
        1/reprobe_every per arm). A probe's time is its arm's round and the catch-up it causes: a drafting arm probed
        among `ar` rounds first ingests the features committed since it last drafted (its own catch-up round); `ar`
        probed among drafting rounds makes the leader catch up after it; and each switch into `ar` (the probe's, or the
        return to an `ar` leader) has its re-entry round. On 2 CPU cores at one stream, with `ar`
        leading, probes with their catch-ups took 12% of `auto`'s time (perf/results/concurrency_cpu_turns_arms.md)."""
        probe = self.round_seconds(bucket, arm)
        if (arm.mode == "ar") != (best.mode == "ar"):   # into the probe and back: each side's switching round
            probe += self.catch_up[(bucket, arm)] + self.catch_up[(bucket, best)]
        slowdown = max(1.0, probe / max(self.round_seconds(bucket, best), 1e-9))
        return self.reprobe_every * slowdown * self.gap(bucket, arm, best) * 2 ** self.misses[(bucket, arm)]

    def gap(self, bucket: int, arm: Arm, best: Arm) -> float:
        """How far below the leader an arm measures, as the factor its re-probes wait longer: the leader's rate / the
        arm's, 1 to MAX_GAP. An arm at half the leader's rate needs its rate doubled to matter, which a few rounds
        rarely bring; one just below the leader may overtake it on the next probe, and is probed as often as before."""
        rate = self.rate(bucket, arm)
        return min(MAX_GAP, max(1.0, self.rate(bucket, best) / rate)) if rate > 0 else MAX_GAP

    def record(self, num_seqs: int, arm: Arm, tokens: int, seconds: float, drafted: bool = True,
               made_programs: bool = False) -> Arm:
        """Account a round of `arm`; returns the arm it is credited to. A round of the policy arm in which no `auto`
        request drafted (the policy's back-off skipped drafting for all of them) was an `ar` round: it is credited
        to `ar` (where `ar` is an arm), so that the policy is judged by the rounds in which it drafted. Otherwise its
        cheap skipped rounds, as fast as `ar`'s, mixed into its rate let it win rounds whose drafting lost (on 2 CPU
        cores at 16 streams it ran 56% of auto's rounds at 0.91x `ar`: concurrency_cpu_turns.md).
        made_programs: the round made static programs of shapes warm-up did not prepare (compiled and, on CUDA,
        captured: a one-off of hundreds of milliseconds, seconds at 27B, against rounds of 1-30 ms), so it is not the
        arm's measure, nor its catch-up's: the same arm runs again next round (choose), and that round counts. On the
        H200 a `dflash` probe at 16 streams measured 900 ms a round this way and was then left alone for good
        (concurrency_h200_groupprefill.md)."""
        b = self.bucket(num_seqs)
        if made_programs:
            self.catching_up, self.repeat = False, (b, arm)
            return arm
        if arm.mode == "policy" and not drafted and AR in self.arms:
            # no catch-up happened (nobody drafted); the policy's next drafting round pays the catch-up its skipping
            # causes, measured: it is the policy's own cost
            self.idle[(b, arm)] += 1   # tried all the same (explored)
            arm, self.catching_up = AR, False
        key = (b, arm)
        self._version[b] += 1
        settled = self._settled_choice.get(b)
        if settled is not None and settled[2] != arm:   # another arm's measure changed: the choice is made again
            del self._settled_choice[b]
        if self.catching_up:   # not its measure: the same arm runs again next round (choose), and that round counts
            self.catching_up, self.repeat = False, key
            self.catch_up[key] = seconds   # what switching to this arm costs on top (reprobe_interval)
            return arm
        mean = self.round_seconds(b, arm)
        if mean > 0 and arm.mode != "policy" and seconds > STALL * mean:
            # a stall (the host, another process, a burst of requests' work) is not the arm's: counted in full, six
            # rounds of 2-13 ms among `ar`'s 0.9 ms took its decayed estimate from 1105 to 254 tok/s, below a tree's
            # stale 296, and the tree ran 76% of a turn at half `ar`'s speed until `ar` was re-probed (through Triton
            # on the H100 at one stream, concurrency_h100_reentry.md, turn 3). A lasting slowdown still moves the mean,
            # by up to (STALL - 1) x (1 - decay) a round. The policy's rounds vary with its trees: never clipped
            seconds = STALL * mean
        probed, best_rate = self.probing.pop(b, (None, 0.0))
        tokens = tokens / max(num_seqs, 1)   # per running request (the class's doc)
        if probed == arm and seconds > 0 and tokens / seconds > best_rate * (1.0 + LEAD_MARGIN):
            # a re-probe beat the leader: try it again at once until its estimate (old rounds decayed) leads or a
            # round of it loses, instead of waiting out a backed-off interval with a stale estimate
            self.misses[key], self.last_tried[key] = 0, -(1 << 30)
        self.tokens[key] = self.decay * self.tokens[key] + tokens
        self.seconds[key] = self.decay * self.seconds[key] + seconds
        self.weight[key] = self.decay * self.weight[key] + 1.0
        if arm.mode != "policy" and self.round_seconds(b, arm) > STALL * seconds:
            # and the other way: its mean round at most STALL x this one, the rounds before were the stall. The first
            # round of a cold engine took 5.4 ms of `ar`'s 0.6-1: its two exploration rounds measured 346 tok/s, a
            # tree's lucky first prompt 1155, and the tree ran 92% of the first pass at half `ar`'s speed until `ar`'s
            # re-probe (in process on the H100, auto_trace_h100_stall.md, pass 1: 0.50 of `ar`)
            self.seconds[key] = STALL * seconds * self.weight[key]
        self.samples[key] += 1
        return arm

    def table(self) -> dict[str, dict[str, float]]:
        """{bucket label: {arm: tokens/s a request}} of what has been measured (for logs and benchmarks)."""
        out: dict[str, dict[str, float]] = {}
        for (b, arm), n in sorted(self.samples.items(), key=lambda kv: (kv[0][0], kv[0][1].name)):
            if n:
                out.setdefault(self.label(b), {})[arm.name] = round(self.rate(b, arm), 2)
        return out

    @staticmethod
    def label(bucket: int) -> str:
        """A bucket's batch sizes: 1, 2, 3-4, 5-8, ..."""
        return "1" if bucket == 0 else "2" if bucket == 1 else f"{2 ** (bucket - 1) + 1}-{2 ** bucket}"
