"""Budget policy: the chosen node counts maximise expected tokens per ms; the arm selector picks the measured best
method per batch size; `auto` stays exact."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

from ddtree.budget import AR, Arm, ArmSelector, CostModel, choose_budgets, expected_tokens, parse_arms
from ddtree.config import EngineConfig
from ddtree.engine import POLICY_MIN_CAP, Engine
from ddtree.sampling_params import SamplingParams
from ddtree.tree import build_tree, top_log_probs

FLAT = CostModel(rows=(1, 4096), verify_ms=(10.0, 10.0), draft_ms=0.0)     # trees are free
STEEP = CostModel(rows=(1, 2, 3, 4096), verify_ms=(10.0, 10.0, 100.0, 1e5), draft_ms=5.0)   # extra rows cost 10x


def brute_force(weights, cost, caps):
    best_rate = -1.0
    for budgets in itertools.product(*[range(c + 1) for c in caps]):
        rows = len(weights) + sum(budgets)
        draft = cost.draft_ms if sum(budgets) else 0.0
        rate = sum(expected_tokens(w, b) for w, b in zip(weights, budgets)) / (draft + cost.verify(rows))
        best_rate = max(best_rate, rate)
    return best_rate


@pytest.mark.parametrize("seed", range(8))
def test_choice_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    weights = [np.sort(rng.random(4) ** 3)[::-1] for _ in range(3)]
    cost = CostModel(rows=(1, 4, 8, 16), verify_ms=tuple(sorted(rng.random(4) * 10 + 1)), draft_ms=float(rng.random()))
    budgets = choose_budgets(weights, cost, [4, 4, 4])
    draft = cost.draft_ms if sum(budgets) else 0.0
    rate = sum(expected_tokens(w, b) for w, b in zip(weights, budgets)) / (draft + cost.verify(3 + sum(budgets)))
    assert rate == pytest.approx(brute_force(weights, cost, [4, 4, 4]), rel=1e-9), f"seed {seed} budgets {budgets}"


def test_trees_pay_only_when_cheap():
    weights = [np.array([0.9, 0.8, 0.5, 0.1]), np.array([0.3, 0.2])]
    assert choose_budgets(weights, FLAT, [4, 2]) == [4, 2]        # free nodes: take them all
    assert choose_budgets(weights, STEEP, [4, 2]) == [0, 0]       # expensive: plain decoding


def test_truncated_tree_is_the_smaller_best_first_tree():
    rng = np.random.default_rng(0)
    log_probs, token_ids = top_log_probs(__import__("torch").tensor(rng.normal(size=(6, 30))), 40)
    full = build_tree(log_probs, token_ids, 40)
    for budget in (0, 1, 7, 20, 40):
        small = build_tree(log_probs, token_ids, budget)
        cut = full.truncated(budget)
        assert (cut.tokens, cut.parents, cut.depths) == (small.tokens, small.parents, small.depths)


@pytest.mark.parametrize("cost", [FLAT, STEEP], ids=["flat", "steep"])
def test_policy_arm_is_exact(tiny_models, tmp_path, cost):
    path = tmp_path / "cost.json"
    path.write_text(__import__("json").dumps({"rows": list(cost.rows), "verify_ms": list(cost.verify_ms),
                                              "draft_ms": cost.draft_ms}))
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=128,
                                 max_tree_budget=64, cost_model_path=str(path), auto_arms="policy"))
    prompt = [5, 6, 7, 8, 9]
    params = dict(max_tokens=30, ignore_eos=True)
    ar = engine.generate_ids(prompt, SamplingParams(mode="ar", **params)).output_ids
    auto = engine.generate_ids(prompt, SamplingParams(mode="auto", tree_budget=32, **params))
    assert auto.output_ids == ar
    nodes = engine.stage_times.tree_nodes
    assert (nodes > 0) if cost is FLAT else (nodes == 0), f"{nodes} tree nodes verified"
    if cost is STEEP:   # trees never pay: after back-off the drafter runs in few of the ~30 rounds
        assert engine.stage_times.draft_passes <= 8, engine.stage_times.draft_passes
        # and it builds small trees: twice the largest budget it chose (none), at least POLICY_MIN_CAP nodes
        assert engine.policy_cap == POLICY_MIN_CAP
    else:               # free nodes: it keeps whole trees, and its cap (twice the last) never cuts one
        fixed = engine.generate_ids(prompt, SamplingParams(mode="ddtree", tree_budget=32, **params))
        assert fixed.output_ids == ar and engine.stage_times.tree_nodes - nodes == nodes


def play(selector: ArmSelector, rates: dict[str, float], num_seqs: int, rounds: int,
         round_seconds: dict[str, float] | None = None, catch_up_seconds: float = 0.0,
         reentry_seconds: float = 0.0) -> dict[str, int]:
    """Run the selector against arms of fixed true rates (tokens per second) and round times; how often each arm
    was chosen for one of `rounds` measured rounds (a drafting arm's catch-up round after `ar` rounds, and `ar`'s
    re-entry round after drafting rounds, are run again, measured, so they are not counted:
    test_a_drafting_round_after_ar_rounds_is_not_its_measure, test_an_ar_round_after_drafting_rounds_is_not_its_measure;
    they take catch_up_seconds and reentry_seconds)."""
    chosen: dict[str, int] = {}
    while sum(chosen.values()) < rounds:
        arm = selector.choose(num_seqs)
        if selector.catching_up:   # the next round repeats the arm
            selector.record(num_seqs, arm, tokens=0, seconds=reentry_seconds if arm.mode == "ar" else catch_up_seconds)
            continue
        chosen[arm.name] = chosen.get(arm.name, 0) + 1
        seconds = (round_seconds or {}).get(arm.name, 1.0)
        selector.record(num_seqs, arm, tokens=round(rates[arm.name] * seconds), seconds=seconds)
    return chosen


def test_slow_arms_are_reprobed_less_often_and_losing_probes_back_off():
    """An arm whose rounds take 4x as long is tried again 4x less often (its probes cost the same time), one at
    half the leader's rate 2x less often (the gap), and every probe that does not win doubles the wait (up to
    2**MAX_BACKOFF): intervals 32, 64, ..., 1024 rounds."""
    from ddtree.budget import MAX_BACKOFF

    selector = ArmSelector(parse_arms("ar,dflash,ddtree-16"), min_samples=2, reprobe_every=16)
    chosen = play(selector, {"ar": 100.0, "dflash": 50.0, "ddtree-16": 50.0}, num_seqs=4, rounds=8000,
                  round_seconds={"ar": 0.1, "dflash": 0.1, "ddtree-16": 0.4})
    # dflash: 2 exploration rounds, then probes after 32, 64, 128, 256, 512, 1024, 1024, ... rounds
    expected, gap, elapsed = 2, 32, 0
    while elapsed + gap < 8000:
        elapsed, expected, gap = elapsed + gap, expected + 1, min(2 * gap, 32 * 2**MAX_BACKOFF)
    assert abs(chosen["dflash"] - expected) <= 2, (chosen, expected)
    assert 2 < chosen["ddtree-16"] < chosen["dflash"]
    assert chosen["ar"] > 8000 - 30


def test_arms_far_below_the_leader_are_reprobed_less_often():
    """Of two arms with rounds as long as the leader's, the one at a quarter of its rate is probed about 4x less often
    than the one at 95% once both backoffs are at their cap, ~3x over the run (MAX_GAP caps the factor: an arm at a
    tenth waits no longer than one at a quarter)."""
    def probes(rate: float) -> int:
        selector = ArmSelector(parse_arms("ar,dflash"), min_samples=2, reprobe_every=8)
        return play(selector, {"ar": 100.0, "dflash": rate}, num_seqs=1, rounds=6000)["dflash"] - 2

    close, far, farther = probes(95.0), probes(25.0), probes(10.0)
    assert 2.5 * far <= close <= 5 * far and farther == far, (close, far, farther)


def test_a_probe_s_catch_up_counts_in_its_cost():
    """A drafting arm probed among `ar` rounds first catches up (ingests the features committed since it last
    drafted): with that round costing 9x a steady one, its probes come 10x less often (each probe's time, catch-up
    included, the same share of the run), so they cost what probes without a catch-up cost."""
    def probes(catch_up: float) -> tuple[int, float]:
        selector = ArmSelector(parse_arms("ar,dflash"), min_samples=2, reprobe_every=16)
        chosen = play(selector, {"ar": 100.0, "dflash": 50.0}, num_seqs=1, rounds=3000, catch_up_seconds=catch_up)
        return chosen["dflash"], selector.reprobe_interval(0, Arm("dflash"), Arm("ar")) / 2 ** selector.misses[(0, Arm("dflash"))]

    cheap, cheap_interval = probes(0.0)
    costly, costly_interval = probes(9.0)
    assert cheap_interval == pytest.approx(16 * 2) and costly_interval == pytest.approx(160 * 2)   # x 2: dflash at half ar's rate
    assert costly < cheap, (costly, cheap)


def test_a_reprobe_that_wins_resets_the_backoff():
    """After the machine changes, the arm that used to lose wins its next re-probe (at most 2**MAX_BACKOFF x
    reprobe_every rounds later), is tried again at once instead of waiting with a stale estimate, leads from then
    on, and its backoff starts over."""
    from ddtree.budget import MAX_BACKOFF

    selector = ArmSelector(parse_arms("ar,ddtree-16"), min_samples=2, reprobe_every=8)
    play(selector, {"ar": 100.0, "ddtree-16": 50.0}, num_seqs=1, rounds=300)
    assert selector.misses[(0, Arm("ddtree", 16))] >= 3
    chosen = play(selector, {"ar": 100.0, "ddtree-16": 300.0}, num_seqs=1, rounds=1000)
    assert chosen["ddtree-16"] >= 1000 - 8 * 2 * 2**MAX_BACKOFF - 3   # a probe waits <= reprobe_every x gap x backoff
    assert selector.misses[(0, Arm("ddtree", 16))] == 0


def test_selector_explores_then_runs_the_measured_best():
    arms = parse_arms("ar,dflash,ddtree-16,policy")
    selector = ArmSelector(arms, min_samples=3, reprobe_every=32)
    rates = {"ar": 20.0, "dflash": 25.0, "ddtree-16": 40.0, "policy": 30.0}
    chosen = play(selector, rates, num_seqs=1, rounds=320)
    assert all(chosen[a.name] >= 4 for a in arms)                      # every arm was measured, and re-probed
    assert chosen["ddtree-16"] >= 320 - 3 * 3 - 3 * (320 // 32)        # the rest went to the best one
    assert selector.table()["1"]["ddtree-16"] == pytest.approx(40.0)


def _noisy_play(selector: ArmSelector, rounds: int, rates, seed: int) -> list[str]:
    """The arms chosen over `rounds` rounds at 4 streams, with round times jittered 5% (measures that drift) and the
    arms' true rates switched halfway (`rates` then `rates` reversed: the leader changes)."""
    rng = np.random.default_rng(seed)
    names = []
    for i in range(rounds):
        arm = selector.choose(4)
        true = rates if i < rounds // 2 else dict(zip(rates, reversed(list(rates.values()))))
        tokens = 1 if arm.mode == "ar" else 3
        selector.record(4, arm, tokens, tokens / true[arm.name] * (1 + 0.05 * rng.random()))
        names.append(arm.name)
    return names


def test_a_settled_choice_is_reused_and_chooses_as_the_full_computation(monkeypatch):
    """Between re-probes the leader's choice is reused (no score of every arm, no re-probe interval per round): the
    rounds `auto` spends settled on one arm cost it O(1) Python. It chooses what the full computation chooses: the
    same arms, in the same rounds, while measures drift and when the leader changes (stationary rates: exact; each
    reuse is rechecked against the others' best score, and recomputed at the first re-probe due)."""
    import ddtree.budget as budget

    arms = parse_arms("ar,dflash,ddtree-8,ddtree-32,policy")
    rates = {"ar": 1000.0, "dflash": 700.0, "ddtree-8": 850.0, "ddtree-32": 600.0, "policy": 800.0}
    # stationary: exactly the same sequence of choices
    fast = play(ArmSelector(arms, reprobe_every=16), rates, num_seqs=4, rounds=6000)
    monkeypatch.setattr(budget, "SETTLED_FOR", 0)   # a settled choice never holds: every round computed in full
    full = play(ArmSelector(arms, reprobe_every=16), rates, num_seqs=4, rounds=6000)
    assert fast == full and fast["ar"] > 5500, (fast, full)
    # drifting measures and a change of leader: the same arms, probes no more frequent
    full_names = _noisy_play(ArmSelector(arms, reprobe_every=16), 6000, rates, seed=0)
    monkeypatch.undo()
    selector = ArmSelector(arms, reprobe_every=16)
    calls = {"n": 0}
    interval = selector.reprobe_interval

    def counted(*args):
        calls["n"] += 1
        return interval(*args)

    monkeypatch.setattr(selector, "reprobe_interval", counted)
    fast_names = _noisy_play(selector, 6000, rates, seed=0)
    for names in (fast_names, full_names):
        assert names[2900:3000].count("ar") > 90 and names[-100:].count("ar") < 10, names[-100:]   # leader changed
    probes = [sum(n != leader for n in names[i: i + 3000]) for names in (fast_names, full_names)
              for i, leader in ((0, "ar"), (3000, "policy"))]
    assert probes[0] <= probes[2] * 1.2 + 5 and probes[1] <= probes[3] * 1.2 + 5, probes
    assert calls["n"] < 6000 * 4 / 8, calls   # the full computation: 4 intervals a round


def test_selector_keeps_batch_sizes_apart_and_follows_a_change(caplog):
    """What wins at 16 streams is learned separately from 1 stream; when the best arm gets slow (another load on
    the machine), the re-probes and the decayed estimate move the choice; each change of a batch size's leading
    arm is logged once, with the rates it was chosen on."""
    from ddtree.budget import TRANSIENT

    selector = ArmSelector(parse_arms("ar,ddtree-16"), min_samples=2, reprobe_every=8)
    with caplog.at_level(logging.INFO, logger="ddtree.budget"):
        play(selector, {"ar": 10.0, "ddtree-16": 30.0}, num_seqs=1, rounds=50)
        play(selector, {"ar": 100.0, "ddtree-16": 60.0}, num_seqs=16, rounds=50)
        assert selector.choose(16).name == "ar"
        # 1 stream again: passing through first (the last arm, test_a_batch_size_passed_through_keeps_the_last_arm),
        # then its own leader once it lasts
        chosen = play(selector, {"ar": 10.0, "ddtree-16": 30.0}, num_seqs=1, rounds=TRANSIENT + 10)
        assert chosen["ddtree-16"] >= 8 and selector.choose(1).name == "ddtree-16"
        chosen = play(selector, {"ar": 10.0, "ddtree-16": 5.0}, num_seqs=1, rounds=200)
    assert chosen["ar"] > 150
    changes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto: batch size")]
    assert changes[:2] == ["auto: batch size 1 runs ddtree-16 (score: measured tokens/s a request, the less measured the "
                           "more optimistic; ar 10.0, ddtree-16 30.0)",
                           "auto: batch size 9-16 runs ar (score: measured tokens/s a request, the less measured the "
                           "more optimistic; ar 6.3, ddtree-16 3.8)"]   # 100 and 60 tokens/s over 16 requests
    assert len(changes) == 3 and changes[2].startswith("auto: batch size 1 runs ar ")   # the slowdown, once


def test_arm_names_are_checked():
    assert parse_arms(" ar , ddtree-8,policy") == (Arm("ar"), Arm("ddtree", 8), Arm("policy"))
    for bad in ("", "beam", "ddtree-0", "ddtree-x"):
        with pytest.raises(ValueError):
            parse_arms(bad)
    with pytest.raises(ValueError, match="auto arm"):
        EngineConfig(target_path="t", drafter_path="d", auto_arms="ar,sparse")


def test_auto_mode_is_exact_with_every_arm(tiny_models):
    """Default arms: the selector switches methods between rounds (exploration visits each arm it does not prune
    several times); output == ar token for token."""
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=160, max_tree_budget=64))
    prompt = [5, 6, 7, 8, 9]
    params = dict(max_tokens=60, ignore_eos=True)
    ar = engine.generate_ids(prompt, SamplingParams(mode="ar", **params)).output_ids
    auto = engine.generate_ids(prompt, SamplingParams(mode="auto", tree_budget=64, **params))
    assert auto.output_ids == ar
    measured = engine.arm_selector.table()["1"]
    assert {"ar", "dflash", "ddtree-4", "policy"} <= set(measured), measured
    assert engine.stage_times.tree_nodes > 0


def test_selector_skips_larger_trees_once_a_tree_clearly_loses_and_trees_above_the_cap():
    """On a compute-bound machine under load every tree loses to ar: once ddtree-4 is measured at < 0.8x of the
    best, ddtree-8..64 are never tried (they are the slowest rounds). Arms above the requests' cap are not tried."""
    selector = ArmSelector(parse_arms("ar,ddtree-4,ddtree-8,ddtree-16,ddtree-64"), min_samples=2, reprobe_every=4)
    chosen = play(selector, {"ar": 100.0, "ddtree-4": 60.0, "ddtree-8": 50.0, "ddtree-16": 40.0, "ddtree-64": 10.0},
                  num_seqs=16, rounds=100)
    assert set(chosen) == {"ar", "ddtree-4"}
    capped, names = ArmSelector(parse_arms("ar,ddtree-16,ddtree-64"), min_samples=1, reprobe_every=2), set()
    for _ in range(20):
        arm = capped.choose(1, max_budget=16)
        capped.record(1, arm, tokens=10, seconds=1.0)
        names.add(arm.name)
    assert names == {"ar", "ddtree-16"}


def test_arms_that_lost_at_a_smaller_batch_are_not_explored_at_a_larger_one():
    selector = ArmSelector(parse_arms("ar,dflash,ddtree-16"), min_samples=2, reprobe_every=1000)
    play(selector, {"ar": 20.0, "dflash": 10.0, "ddtree-16": 30.0}, num_seqs=1, rounds=20)    # dflash loses at 1
    chosen = play(selector, {"ar": 100.0, "dflash": 10.0, "ddtree-16": 90.0}, num_seqs=16, rounds=20)
    assert "dflash" not in chosen and chosen["ddtree-16"] == 2 and chosen["ar"] == 18


def test_what_lost_to_lighter_drafting_at_a_smaller_batch_is_not_explored_at_a_larger_one():
    """CPU-like: at one stream every drafting arm loses to ar, so at 16 streams only ar and the policy are explored
    (two rounds each) instead of paying two slow rounds per arm again. GPU-like: at one stream ddtree-64 leads and
    ddtree-16 loses only to that heavier tree, so at 4 streams both are explored (a smaller tree may win there)."""
    arms = "ar,dflash,ddtree-4,ddtree-16,ddtree-64,policy"
    cpu = ArmSelector(parse_arms(arms), min_samples=2, reprobe_every=1000)
    play(cpu, {"ar": 20.0, "dflash": 8.0, "ddtree-4": 15.0, "ddtree-16": 18.0, "ddtree-64": 9.0, "policy": 19.0},
         num_seqs=1, rounds=30)
    chosen = play(cpu, {"ar": 100.0, "dflash": 20.0, "ddtree-4": 60.0, "ddtree-16": 50.0, "ddtree-64": 10.0,
                        "policy": 95.0}, num_seqs=16, rounds=40)
    assert set(chosen) == {"ar", "policy"} and chosen["policy"] <= 6      # 2 to explore, a few from its UCB bonus
    gpu = ArmSelector(parse_arms(arms), min_samples=2, reprobe_every=1000)
    play(gpu, {"ar": 20.0, "dflash": 25.0, "ddtree-4": 30.0, "ddtree-16": 40.0, "ddtree-64": 50.0, "policy": 45.0},
         num_seqs=1, rounds=30)
    chosen = play(gpu, {"ar": 60.0, "dflash": 50.0, "ddtree-4": 80.0, "ddtree-16": 90.0, "ddtree-64": 70.0,
                        "policy": 85.0}, num_seqs=4, rounds=40)
    assert set(chosen) == {"ar", "ddtree-4", "ddtree-16", "ddtree-64", "policy"}   # dflash lost to ddtree-4 at 1
    assert chosen["ddtree-16"] >= 40 - 4 * 2 - 6


def test_a_policy_that_lost_to_ar_at_a_smaller_batch_is_not_explored_at_a_larger_one():
    """The policy drafts too (its trees vary round by round): below PRUNE_ACROSS x `ar` at 9-16 requests it is not
    explored at 17-32, where its rounds cost the most (on the H200, ~10 ms against `ar`'s 1.8); within that margin it
    still is (it may pay where the fixed trees do not)."""
    arms = "ar,dflash,ddtree-4,policy"
    for policy_at_16, explored_at_32 in ((80.0, False), (97.0, True)):
        selector = ArmSelector(parse_arms(arms), min_samples=2, reprobe_every=1000)
        play(selector, {"ar": 100.0, "dflash": 30.0, "ddtree-4": 50.0, "policy": policy_at_16}, num_seqs=16, rounds=40)
        chosen = play(selector, {"ar": 150.0, "dflash": 30.0, "ddtree-4": 50.0, "policy": 140.0}, num_seqs=32,
                      rounds=40)
        assert ("policy" in chosen) == explored_at_32 and "dflash" not in chosen and "ddtree-4" not in chosen, chosen


def test_auto_charges_each_round_the_serving_work_since_the_last_one(tiny_models):
    """What a round costs auto is the time since the previous round ended (less a new request's prefill): the work a
    serving loop does between steps (streaming, cancellation checks) is paid once per round, so an arm that commits
    more tokens per round pays it less often. An idle spell longer than MAX_SERVE_GAP_S is not charged."""
    import time

    from ddtree.engine import MAX_SERVE_GAP_S
    from ddtree.request import Request

    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=160, max_tree_budget=16))
    charged = []
    record = engine.arm_selector.record
    engine.arm_selector.record = lambda n, arm, tokens, seconds, **kw: (
        charged.append(seconds), record(n, arm, tokens, seconds, **kw))[1]
    engine.add(Request("a", [5, 6, 7], SamplingParams(mode="auto", tree_budget=16, max_tokens=12, ignore_eos=True)))
    engine.step()                        # prefill only: no round
    gaps = []
    while engine.has_work:
        t0 = time.perf_counter()
        engine.step()
        gaps.append(time.perf_counter() - t0)
        time.sleep(0.03)                 # the serving loop's work between two steps
    assert len(charged) >= 2
    # the first round follows a prefill-only step: it is charged its own step's time at most (whatever this machine's
    # speed), the others the serving work before them too
    assert charged[0] <= gaps[0] and 0.03 <= min(charged[1:]), (charged, gaps)
    assert all(c <= g + 0.03 + 0.02 for c, g in zip(charged[1:], gaps[1:])), (charged, gaps)
    assert engine._cycle_start(10.0, 0.0) == 10.0                                 # no round before
    engine._round_end = 10.0 - MAX_SERVE_GAP_S - 0.1
    assert engine._cycle_start(10.0, 0.0) == 10.0                                 # idle: the round alone
    engine._round_end = 9.9
    assert engine._cycle_start(10.0, 0.05) == pytest.approx(9.95)                 # serving work, less the prefill


def test_a_drafting_round_after_ar_rounds_is_not_its_measure():
    """The first drafting round after `ar` rounds ingests every feature committed meanwhile (a catch-up steady
    drafting never pays): it is not recorded, and the same arm runs again, measured. Charged with the catch-up,
    a tree 10% faster than ar in steady state would look slower and never be chosen."""
    selector = ArmSelector(parse_arms("ar,ddtree-16"), min_samples=2, reprobe_every=16)
    chosen, last = {"ar": 0, "ddtree-16": 0}, None
    for _ in range(400):
        arm = selector.choose(1)
        catch_up = (arm.mode != "ar") != (last is not None and last.mode != "ar") if last is not None else arm.mode != "ar"
        assert selector.catching_up == catch_up
        seconds = 5.0 if catch_up else 1.0                  # the catch-up round: 5x a steady round
        selector.record(1, arm, tokens=110 if arm.mode != "ar" else 100, seconds=seconds)
        chosen[arm.name] += 1
        last = arm
    assert chosen["ddtree-16"] > 400 - 40, chosen
    assert selector.rate(0, Arm("ddtree", 16)) == pytest.approx(110.0)


def test_an_ar_round_after_drafting_rounds_is_not_its_measure():
    """The first `ar` round after drafting rounds starts the lookahead again and waits for the drafting round's
    deferred device work: it is not `ar`'s measure either, and `ar` runs again, measured. Charged with that round
    (here 5x a steady one), an `ar` 10% faster than the tree in steady state, probed among the tree's rounds, would
    look 4x slower and the tree would keep the lead; not charged, `ar` takes it and keeps it."""
    selector = ArmSelector(parse_arms("ar,ddtree-16"), min_samples=2, reprobe_every=16)
    for _ in range(40):   # the tree leads first (the machine changed after: ar is now the faster)
        arm = selector.choose(1)
        selector.record(1, arm, tokens=100 if arm.mode == "ar" else 300, seconds=1.0)
    assert selector.choose(1).mode == "ddtree"
    selector.record(1, Arm("ddtree", 16), tokens=300, seconds=1.0)
    chosen, last = {"ar": 0, "ddtree-16": 0}, Arm("ddtree", 16)
    for _ in range(3000):
        arm = selector.choose(1)
        reentry = arm.mode == "ar" and last.mode != "ar"
        assert selector.catching_up == (reentry or (arm.mode != "ar" and last.mode == "ar"))
        seconds = 5.0 if reentry else 1.0
        selector.record(1, arm, tokens=110 if arm.mode == "ar" else 100, seconds=seconds)
        chosen[arm.name] += 1
        last = arm
    assert selector.rate(0, AR) == pytest.approx(110.0, rel=1e-3)   # its re-entry rounds never counted
    assert chosen["ar"] > 3000 - 300, chosen
    assert selector.catch_up[(0, AR)] == 5.0                         # but each costs an `ar` probe (reprobe_interval)


def test_default_cost_model_follows_device_and_target_dimensions():
    """CUDA: the H200 data measured for a target of these dimensions (Qwen3.6-27B: 5120 x 64, Qwen3-8B: 4096 x 36),
    else the embedded default's; the CPU: CPU data. Past its last point a model extends its last segment (np.interp
    alone would hold the last value: a tree larger than the data would look as cheap as the largest measured)."""
    from ddtree.budget import DATA, default_cost_model

    assert default_cost_model("cuda:0", 5120, 64).name == "cost_model_h200_5120x64.json"
    assert default_cost_model("cuda", 4096, 36).name == "cost_model_h200_4096x36.json"
    assert default_cost_model("cuda", 576, 30).name == "cost_model_h200.json"
    assert default_cost_model("cpu", 5120, 64).name == "cost_model_cpu.json"
    for path in DATA.glob("cost_model_*.json"):
        model = CostModel.load(path)
        assert model.rows[0] == 1 and model.rows[-1] >= 256, path.name
        slope = (model.verify_ms[-1] - model.verify_ms[-2]) / (model.rows[-1] - model.rows[-2])
        assert model.verify(2 * model.rows[-1]) == pytest.approx(model.verify_ms[-1] + max(slope, 0) * model.rows[-1])
        if "x" in path.stem.rsplit("_", 1)[-1]:   # the shaped models: measured to 1025 rows, growing with the tree
            assert model.rows[-1] >= 1025 and model.verify(1025) > 2 * model.verify(1), path.name


def _policy_share(credit_skipped_rounds: bool) -> float:
    """Share of 3000 rounds the selector runs the policy arm when the policy drafts in 1 round of 8 (at 50 tokens/s)
    and skips drafting in the others (an `ar` round, here at 110 tokens/s against `ar`'s 100: a mixture of 102.5)."""
    selector = ArmSelector(parse_arms("ar,policy"), min_samples=2, reprobe_every=16)
    policy_rounds = 0
    for _ in range(3000):
        arm = selector.choose(1)
        drafted, rate = False, 100.0
        if arm.mode == "policy":
            policy_rounds += 1
            drafted = policy_rounds % 8 == 0
            rate = 50.0 if drafted else 110.0
        selector.record(1, arm, tokens=round(rate), seconds=1.0, drafted=drafted or not credit_skipped_rounds)
    return policy_rounds / 3000


def test_policy_rounds_in_which_nobody_drafted_count_as_ar():
    """The policy is judged by the rounds in which it drafted: its skipped rounds are `ar` rounds. Mixed into its
    rate they let it win although every round in which it drafts loses (the control: the same play without the
    crediting runs the policy in ~15% of the rounds, with it under 1%)."""
    selector = ArmSelector(parse_arms("ar,policy"))
    assert selector.record(1, Arm("policy"), tokens=1, seconds=1.0, drafted=False) == Arm("ar")
    assert selector.samples[(0, Arm("ar"))] == 1 and selector.samples[(0, Arm("policy"))] == 0
    assert selector.record(1, Arm("policy"), tokens=1, seconds=1.0, drafted=True) == Arm("policy")
    assert ArmSelector(parse_arms("policy")).record(1, Arm("policy"), 1, 1.0, drafted=False) == Arm("policy")  # no ar arm
    assert _policy_share(credit_skipped_rounds=False) > 0.1
    assert _policy_share(credit_skipped_rounds=True) < 0.05


def test_a_settled_choice_is_dropped_when_another_arm_is_credited():
    """The policy leads and its settled choice is reused; then its rounds stop drafting (credited to `ar`, at a
    rate above the policy's): `ar` leads from the round its score passes the policy's, as the full computation
    has it, not once the settled choice runs out."""
    selector = ArmSelector(parse_arms("ar,policy"), reprobe_every=64)
    play(selector, {"ar": 50.0, "policy": 100.0}, num_seqs=1, rounds=200)
    assert selector.choose(1) == Arm("policy")
    selector.record(1, Arm("policy"), tokens=100, seconds=1.0)
    passed = None
    for i in range(40):
        arm = selector.choose(1)
        if arm == Arm("ar"):
            break
        selector.record(1, arm, tokens=400, seconds=1.0, drafted=False)   # credited to ar at 400 tokens/s
        if passed is None and selector.score(0, Arm("ar")) > selector.score(0, Arm("policy")):
            passed = i
    assert arm == Arm("ar") and passed is not None and i == passed + 1, (i, passed)


def test_a_round_that_made_programs_is_not_its_arms_measure():
    """A round that compiled (CUDA: captured) a static program warm-up did not make is a one-off, not the arm's cost
    nor its catch-up's: nothing of it is recorded, and the same arm runs again next round, measured."""
    selector = ArmSelector(parse_arms("ar,dflash"), min_samples=1, reprobe_every=16)
    b = selector.bucket(16)
    for arm in (Arm("ar"), Arm("dflash")):
        selector.choose(16)
        selector.record(16, arm, tokens=16, seconds=0.01)
    rates = {arm: selector.rate(b, arm) for arm in (Arm("ar"), Arm("dflash"))}
    arm = selector.choose(16)
    assert selector.record(16, arm, tokens=16, seconds=0.9, made_programs=True) == arm
    assert {a: selector.rate(b, a) for a in rates} == rates
    assert selector.choose(16) == arm and selector.choose(16) is not None
    # a drafting arm's catch-up round that made programs: its catch-up cost is not stored either
    selector.catching_up, selector.catch_up[(b, Arm("dflash"))] = True, 0.002
    selector.record(16, Arm("dflash"), tokens=16, seconds=0.9, made_programs=True)
    assert selector.catch_up[(b, Arm("dflash"))] == 0.002 and not selector.catching_up
    assert selector.choose(16) == Arm("dflash")


def test_the_engine_tells_the_selector_which_rounds_made_programs(tiny_models):
    """After warm-up, the round whose static programs were not prepared (an `auto` request's `dflash` rounds at two
    requests: warm-up makes the batch programs of one-token steps and the lone request's, and here none of several
    requests' trees, static_batch_memory 0) is flagged, and the next rounds of that shape are not."""
    from ddtree.request import Request

    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                                 max_model_len=160, max_num_seqs=2, static_forward="on", static_prefill=0,
                                 static_batch_memory=0))
    engine.warm_up()
    engine.arm_selector.choose = lambda num_seqs, max_budget=None, chain=True: Arm("dflash")
    flags = []
    record = engine.arm_selector.record
    engine.arm_selector.record = lambda *a, made_programs=False, **kw: (flags.append(made_programs),
                                                                         record(*a, made_programs=made_programs, **kw))[1]
    for i in range(2):
        engine.add(Request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(mode="auto", tree_budget=16, max_tokens=24,
                                                                     ignore_eos=True)))
    late = []
    while engine.has_work:
        before = len(engine.graphs.late_keys)
        engine.step()
        late.append(len(engine.graphs.late_keys) > before)
    assert flags == late[-len(flags):] and any(flags) and not all(flags), (flags, engine.graphs.late_keys)


def test_a_policy_that_drafts_for_nobody_is_explored_and_then_only_re_probed():
    """Rounds of the policy arm in which nobody drafted are credited to `ar`, so such a policy never gathers samples
    of its own. Counted unexplored, it was chosen in every round of its bucket (each a plain step without `ar`'s
    lookahead: all the rounds of the drains of batches on the H200). Now IDLE_EXPLORED such rounds explore it: it
    scores 0 and is re-probed like a losing arm, in a small share of the rounds, not never."""
    from ddtree.budget import IDLE_EXPLORED

    selector = ArmSelector(parse_arms("ar,policy"))
    chosen = []
    for _ in range(3000):
        arm = selector.choose(4)
        chosen.append(arm)
        selector.record(4, arm, tokens=4, seconds=0.002, drafted=False)   # the policy's back-off: no tree drafted
    b = selector.bucket(4)
    assert selector.samples[(b, Arm("policy"))] == 0 and selector.idle[(b, Arm("policy"))] >= IDLE_EXPLORED
    assert selector.explored(b, Arm("policy")) and selector.score(b, Arm("policy")) == 0.0
    first = chosen.index(Arm("policy"))
    assert chosen[first:first + IDLE_EXPLORED] == [Arm("policy")] * IDLE_EXPLORED   # explored at once
    later = chosen[first + IDLE_EXPLORED:]
    assert 0 < later.count(Arm("policy")) < 0.01 * len(later)   # re-probed, rarely
    assert ArmSelector(parse_arms("ar,policy")).score(b, Arm("policy")) == float("inf")   # never tried: try it


def _lead_then(selector: ArmSelector, tree_rate: float) -> None:
    """Explore ar (1000 tok/s: 1 token in 1 ms rounds) and ddtree-4 (tree_rate: 3 tokens a round) at one stream, then
    run until ar leads and its estimate is steady."""
    for _ in range(120):
        arm = selector.choose(1)
        tokens = 1 if arm.mode == "ar" else 3
        selector.record(1, arm, tokens=tokens, seconds=tokens / (1000.0 if arm.mode == "ar" else tree_rate))
    assert selector.choose(1) == AR
    selector.record(1, AR, tokens=1, seconds=0.001)


def test_a_stall_of_a_few_rounds_does_not_hand_the_lead_to_a_slower_arm():
    """Six `ar` rounds 2-13x as long as its others (a stall of the host: through Triton on the H100 at one stream,
    concurrency_h100_reentry.md) count at most STALL x its mean round each: `ar` keeps the lead over a tree at half its
    rate. Counted in full, its estimate fell below the tree's and the tree ran for hundreds of rounds (mutation:
    STALL = inf, the tree takes the lead within the stall)."""
    selector = ArmSelector(parse_arms("ar,ddtree-4"), min_samples=2, reprobe_every=256)
    _lead_then(selector, tree_rate=500.0)
    for seconds in (0.0093, 0.0113, 0.0047, 0.0035, 0.0022, 0.0132):   # the trace's stall, ar's rounds
        assert selector.choose(1) == AR
        selector.record(1, AR, tokens=1, seconds=seconds)
    assert selector.rate(0, AR) > 600
    chosen = play(selector, {"ar": 1000.0, "ddtree-4": 500.0}, num_seqs=1, rounds=300,
                  round_seconds={"ar": 0.001, "ddtree-4": 0.003})
    assert chosen.get("ddtree-4", 0) <= 4, chosen
    # a lasting slowdown still moves the estimate: ar at a fifth of its speed from now on loses the lead
    chosen = play(selector, {"ar": 200.0, "ddtree-4": 500.0}, num_seqs=1, rounds=400,
                  round_seconds={"ar": 0.005, "ddtree-4": 0.003})
    assert chosen["ddtree-4"] > 300, chosen


def test_the_leader_keeps_the_lead_within_the_margin():
    """A tree estimated 2% below `ar` (a few lucky rounds) does not take the lead when one slow `ar` round (1.4x,
    within STALL) drops `ar`'s estimate by ~4%: switching would cost a catch-up round and re-time every re-probe
    (on the H100 in process, such a swap and the probes after it cost 10% of a pass: auto_trace_h100_reentry.md).
    Mutation: LEAD_MARGIN = 0, the tree runs next."""
    selector = ArmSelector(parse_arms("ar,ddtree-4"), min_samples=2, reprobe_every=256)
    _lead_then(selector, tree_rate=910.0)
    before = selector.score(0, AR)
    assert 0.97 * before < selector.score(0, Arm("ddtree", 4)) < before
    assert selector.choose(1) == AR
    selector.record(1, AR, tokens=1, seconds=0.0014)
    tree = Arm("ddtree", 4)
    assert selector.score(0, AR) < selector.score(0, tree) < before   # the raw scores swapped
    assert selector.choose(1) == AR


def test_a_slow_first_round_does_not_hold_an_arm_s_estimate_down():
    """The first `ar` round of a cold engine took 5.4 ms, its next 0.6 (in process on the H100,
    auto_trace_h100_stall.md): the mean round is kept within STALL x the newest one, so `ar`'s exploration measures
    ~1000 tok/s, not 346, and once a tree's lucky start (1155 tok/s on one prompt, 500 after) fades, `ar` leads.
    Mutation: no cap, the tree runs 298 of the first 300 rounds."""
    selector = ArmSelector(parse_arms("ar,ddtree-4"), min_samples=2, reprobe_every=256)
    first = {"ar": [0.0054, 0.0006], "ddtree-4": [0.003] * 2}
    tree_tokens = iter([4, 3, 5, 3, 3])
    chosen = {"ar": 0, "ddtree-4": 0}
    for _ in range(300):
        arm = selector.choose(1)
        if arm.mode == "ar":
            tokens, seconds = 1, (first["ar"].pop(0) if first["ar"] else 0.001)
        elif selector.catching_up:
            tokens, seconds = 1, 0.006
        else:
            tokens, seconds = next(tree_tokens, 1), 0.002
        chosen[arm.name] += 1
        selector.record(1, arm, tokens=tokens, seconds=seconds)
    assert chosen["ddtree-4"] < 60, chosen
    assert selector.rate(0, AR) > 900


def test_a_draining_batch_is_judged_per_request():
    """Bucket 9-16: `ar` (1 token a request, rounds of 1 + 0.03 n ms) and a tree (1.5 tokens a request, 3 ms rounds)
    measured at 16 requests, `ar` ahead. As the batch drains to 9, `ar`'s tokens a round fall by 44%, its rounds by
    far less: in tokens/s it would fall below the tree's estimate from 16 requests, and the tree would run; per request
    both move with the round time alone, and `ar` keeps the lead (mutation: not per request, the tree runs in the
    drain)."""
    selector = ArmSelector(parse_arms("ar,ddtree-32"), min_samples=2, reprobe_every=256)

    def round_of(n: int) -> str:
        arm = selector.choose(n)
        tokens, seconds = (n, (1.0 + 0.03 * n) / 1e3) if arm.mode == "ar" else (round(1.5 * n), 0.003)
        selector.record(n, arm, tokens=tokens, seconds=seconds)
        return arm.name

    for _ in range(60):
        round_of(16)
    assert selector.choose(16) == AR
    selector.record(16, AR, tokens=16, seconds=0.00148)
    drain = [round_of(n) for n in range(15, 8, -1) for _ in range(8)]
    assert drain == ["ar"] * len(drain), drain


def test_a_batch_size_passed_through_keeps_the_last_arm():
    """Waves of 16 requests through Triton: each wave ends within a few rounds and the next arrives over a few more,
    so rounds of 1-5 requests come between rounds of 12-16. Those batch sizes are passed through: their rounds keep the
    last arm (`ar`, the leader at 16) and explore nothing, where each exploring round of a drafting arm cost a catch-up
    (on the H100: auto_trace_h100_perrequest_c16.md). When the load stays at 2 streams for longer than TRANSIENT
    rounds, that batch size is explored and its own leader (a tree, there) runs. Mutation: no passing through, the
    drains explore every drafting arm."""
    from ddtree.budget import TRANSIENT

    selector = ArmSelector(parse_arms("ar,dflash,ddtree-8"), min_samples=2, reprobe_every=256)
    rates = {"ar": 1000.0, "dflash": 600.0, "ddtree-8": 700.0}   # at 16 requests (tokens/s a request x 16 below)
    small = {"ar": 1000.0, "dflash": 1500.0, "ddtree-8": 1800.0}   # at 1-3 requests the trees pay
    play(selector, {a: 16 * r for a, r in rates.items()}, num_seqs=16, rounds=60)   # explored at 16: ar leads
    drains = []
    for _ in range(20):   # waves: 57 rounds of 16, the drain 15, 14, 12, then the refill 1, 3
        play(selector, {a: 16 * r for a, r in rates.items()}, num_seqs=16, rounds=57)
        for n in (15, 14, 12, 1, 3):
            drains.append(selector.choose(n).name)
            selector.record(n, Arm.parse(drains[-1]), tokens=n, seconds=0.001)
    assert drains == ["ar"] * len(drains), drains
    chosen = play(selector, {a: 2 * r for a, r in small.items()}, num_seqs=2, rounds=TRANSIENT + 200)
    assert chosen["ddtree-8"] > 150, chosen


def small_verifies_engine(tiny_models, memory: int, **config) -> tuple[Engine, set]:
    """An engine warmed up with static forwards on the CPU whose verifies of several requests' trees hold 1/8 MiB a row
    (a stand-in for CUDA's allocator) within `memory` MiB: at 8, small ones only. Returns it and the (requests, rows)
    of the verifies made."""
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"),
                                 drafter_path=str(tiny_models / "qwen3-dflash"), max_model_len=160, max_num_seqs=4,
                                 static_forward="on", static_prefill=0, static_batch_memory=memory, **config))
    verifies = lambda: [key for key in engine.graphs.programs if key[0] == "batch" and key[1] > 1 and key[2] > 1]  # noqa: E731
    engine._allocated_bytes = lambda: 2**20 * sum(key[1] * key[2] for key in verifies()) // 8
    engine.warm_up()
    return engine, {(key[1], key[2]) for key in verifies()}


def serve_three_auto(engine: Engine, tree_budget: int, max_tokens: int) -> None:
    """Three greedy `auto` requests decoded together after warm-up give the target's own greedy tokens."""
    from ddtree.request import Request

    params = dict(max_tokens=max_tokens, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(3)]
    expected = [engine.generate_ids(p, SamplingParams(mode="ar", **params)).output_ids for p in prompts]
    for i, prompt in enumerate(prompts):
        engine.add(Request(f"r{i}", prompt, SamplingParams(mode="auto", tree_budget=tree_budget, **params)))
    outputs = {}
    while engine.has_work:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert [outputs[f"r{i}"] for i in range(3)] == expected


@pytest.mark.parametrize("memory", [8, 0])
def test_the_policy_cuts_trees_of_several_requests_to_the_verifies_warm_up_made(tiny_models, tmp_path, memory):
    """After warm-up the policy arm builds no tree of several requests past the row bucket of the verifies warm-up made
    for their batch (here small ones only): a program made on a round's time stalls every stream (a 162 ms step at
    c=32 on an H100, concurrency_h100_child_c32_split.md). Free nodes (FLAT) would take whole 17-row trees otherwise.
    With 0 MiB warm-up makes none and they are made on first use, as that setting says."""
    path = tmp_path / "cost.json"
    path.write_text(__import__("json").dumps({"rows": list(FLAT.rows), "verify_ms": list(FLAT.verify_ms),
                                              "draft_ms": FLAT.draft_ms}))
    engine, made = small_verifies_engine(tiny_models, memory, cost_model_path=str(path))   # the default arms' verifies
    assert bool(made) == bool(memory) and all(rows < 17 for _, rows in made), made   # no 16-node tree's 17 rows
    engine.arm_selector.choose = lambda num_seqs, max_budget=None, chain=True: Arm("policy")
    nodes = engine.stage_times.tree_nodes
    serve_three_auto(engine, tree_budget=16, max_tokens=24)
    late = [key for key in engine.graphs.late_keys if key[1] > 1]
    assert bool(late) == (not memory), engine.graphs.late_keys
    assert engine.stage_times.tree_nodes > nodes


def test_auto_leaves_out_the_arms_whose_trees_no_verify_warm_up_made_would_take(tiny_models):
    """After warm-up `auto` explores its arms at each batch size; a `ddtree` arm whose trees, or the `dflash` arm whose
    chains, no made verify of that batch takes (here warm-up made small ones only) is left out there, not run with a
    program made on its time."""
    engine, _ = small_verifies_engine(tiny_models, 8)
    serve_three_auto(engine, tree_budget=64, max_tokens=48)
    ran = set(engine.stage_times.auto_arm_rounds)
    assert "ddtree-4" in ran and not ran & {"dflash", "ddtree-8", "ddtree-16", "ddtree-32", "ddtree-64"}, ran   # what fits
    assert not [key for key in engine.graphs.late_keys if key[1] > 1], engine.graphs.late_keys
