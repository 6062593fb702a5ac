"""perf/admission_probe.py on tiny models (CPU): requests kept running and replaced as they finish, every step timed
and split into the settle of queued steps, the prefill and the rest; the prefill's functions profiled."""

from __future__ import annotations

import json

from perf import admission_probe


def test_admission_probe_splits_the_steps_that_admit(tiny_models, tmp_path):
    result = admission_probe.main(["--target", str(tiny_models / "qwen3-target"), "--drafter",
                                   str(tiny_models / "qwen3-dflash"), "--methods", "ar,auto", "--slots", "3",
                                   "--requests", "7", "--warm-requests", "5", "--no-freeze-heap", "--max-tokens", "6",
                                   "--spread", "3", "--top", "4", "--out", str(tmp_path), "--name", "a"])
    for method in ("ar", "auto"):
        r = result["methods"][method]
        admitting, decoding = r["admitting"], r["decoding"]
        # every request admitted once: the first 3 together, the others as the running ones finish (max_tokens apart)
        assert admitting["requests"] == 7 and 1 < admitting["steps"] < 7 and decoding["steps"] > 0
        assert abs(admitting["ms"] - admitting["settle_ms"] - admitting["prefill_ms"] - admitting["rest_ms"]) < 1e-6
        assert len(r["prefill_ms_by_group"]) >= 2   # groups of different sizes
        assert r["prefill_functions_us"][0][0].endswith("_prefill") and len(r["prefill_functions_us"]) == 4
        assert r["tokens_per_s"] > 0
    assert sum(result["methods"]["auto"]["arms"].values()) > 0 and not result["methods"]["ar"]["arms"]
    # auto's choices by batch size: every round of the measured run chose once (a catch-up round's repeat included)
    by_batch = result["methods"]["auto"]["arms_by_batch"]
    assert set(by_batch) <= {"1", "2", "3-4"} and sum(sum(a.values()) for a in by_batch.values()) >= \
        sum(result["methods"]["auto"]["arms"].values())
    assert not result["methods"]["ar"]["arms_by_batch"] and result["warm_requests"] == 5
    # ar's steps all run `ar`; auto's on `ar` are those of its rounds it chose `ar` for
    ar = result["methods"]["ar"]
    assert ar["decoding_on_ar"]["steps"] == ar["decoding"]["steps"] and ar["no_round_steps"] >= 1   # the first step
    assert ar["admitting_on_ar"]["steps"] + ar["no_round_steps"] == ar["admitting"]["steps"]
    on_ar = result["methods"]["auto"]["decoding_on_ar"]["steps"] + result["methods"]["auto"]["admitting_on_ar"]["steps"]
    assert on_ar == sum(a.get("ar", 0) for a in by_batch.values())
    assert json.loads((tmp_path / "a.json").read_text())["spread"] == 3
    assert "prefill ms by requests admitted together" in (tmp_path / "a.md").read_text()


def test_admission_probe_profiles_the_slow_steps(tiny_models, tmp_path):
    """--profile-slow: every step under its own cProfile, the functions of those over the threshold kept (here all)."""
    result = admission_probe.main(["--target", str(tiny_models / "qwen3-target"), "--drafter",
                                   str(tiny_models / "qwen3-dflash"), "--methods", "auto", "--slots", "2",
                                   "--requests", "3", "--max-tokens", "4", "--spread", "1", "--top", "30",
                                   "--profile-slow", "0.000001", "--no-freeze-heap", "--out", str(tmp_path), "--name", "p"])
    r = result["methods"]["auto"]
    assert len(r["slow_profiles"]) == r["steps"] and r["late_programs"] == []
    assert all(any(name.endswith(":step") for name, _ in slow["functions"]) for slow in r["slow_profiles"])
    assert len(r["slowest_steps"]) == min(8, r["steps"]) and "a step of" in (tmp_path / "p.md").read_text()


def test_admission_probe_turns_alternate_the_order_and_report_ratios(tiny_models, tmp_path):
    """--turns: every method measured once a turn (the second turn in reverse order); each turn's tokens/s over the
    first method's, their median and worst, written to the report."""
    result = admission_probe.main(["--target", str(tiny_models / "qwen3-target"), "--drafter",
                                   str(tiny_models / "qwen3-dflash"), "--methods", "ar,auto", "--slots", "2",
                                   "--requests", "3", "--warm-requests", "2", "--max-tokens", "4", "--spread", "1",
                                   "--turns", "2", "--no-freeze-heap", "--out", str(tmp_path), "--name", "t"])
    turns = result["turns"]
    assert len(turns) == 2 and list(turns[0]) == ["ar", "auto"] and list(turns[1]) == ["auto", "ar"]
    assert turns[0]["ar"]["tokens_per_s"] == result["methods"]["ar"]["tokens_per_s"]   # the first turn's tables
    by_turn = [t["auto"]["tokens_per_s"] / t["ar"]["tokens_per_s"] for t in turns]
    ratios = result["ratios"]["auto"]
    assert ratios["by_turn"] == by_turn and ratios["worst"] == min(by_turn)
    assert abs(ratios["median"] - sum(by_turn) / 2) < 1e-12
    assert turns[1]["auto"]["arms"] and not turns[1]["ar"]["arms"]
    assert "auto / ar: median turn" in (tmp_path / "t.md").read_text()
