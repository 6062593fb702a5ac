"""perf/concurrency_sweep.py's bookkeeping: a point is its median run; `auto` is compared turn by turn."""

import math

import pytest

from perf.concurrency_sweep import (
    SENDER,
    idle_runs,
    level_table,
    median_run,
    paired_ratios,
    sender_cell,
    sender_rates,
    stalls_cell,
    wall_ms_per_round,
)


def runs(*values):
    return median_run([{"tokens_per_s": v, "ttft_ms_p50": 10 * v} for v in values])


def test_a_point_is_its_median_run_with_every_run_beside_it():
    entry = runs(300.0, 100.0, 200.0)
    assert entry["tokens_per_s"] == 200.0 and entry["ttft_ms_p50"] == 2000.0   # the median run's own numbers
    assert entry["runs_tokens_per_s"] == [300.0, 100.0, 200.0]
    assert runs(5.0, 1.0)["tokens_per_s"] == 1.0   # an even count: the lower middle run, a measured one


def test_auto_is_compared_with_the_best_other_method_of_the_same_turn():
    methods = {"ar": {"4": runs(100.0, 200.0, 150.0)},
               "ddtree-16": {"4": runs(120.0, 150.0, 100.0)},
               "auto": {"4": runs(110.0, 190.0, 160.0)}}
    row = paired_ratios(methods)["4"]
    assert row["best_per_run"] == ["ddtree-16", "ar", "ar"]
    assert row["over_best"] == pytest.approx([110 / 120, 190 / 200, 160 / 150])
    assert row["over_best_min"] == pytest.approx(110 / 120)
    assert row["over_best_median"] == pytest.approx(190 / 200)
    assert row["over_ar"] == pytest.approx([1.1, 0.95, 160 / 150])
    # the medians of each method alone (ar 150, auto 160) would hide the turn auto lost by 8%


def test_the_a_a_control_is_not_a_method_auto_is_compared_with_but_has_its_own_ratio_to_ar():
    from perf.concurrency_sweep import CONTROL

    methods = {"ar": {"4": runs(100.0, 200.0)}, CONTROL: {"4": runs(130.0, 180.0)}, "auto": {"4": runs(110.0, 190.0)}}
    row = paired_ratios(methods)["4"]
    assert row["best_per_run"] == ["ar", "ar"]   # not the control's luckier first run
    assert row["over_best"] == pytest.approx([1.1, 0.95])
    control = paired_ratios({n: methods[n] for n in ("ar", CONTROL)}, CONTROL)["4"]
    assert control["over_ar"] == pytest.approx([1.3, 0.9]) and control["over_ar_min"] == pytest.approx(0.9)


def test_no_auto_or_nothing_to_compare_gives_no_ratios():
    assert paired_ratios({"ar": {"1": runs(1.0)}}) == {}
    assert paired_ratios({"auto": {"1": runs(1.0)}}) == {}


def test_a_sweep_split_over_commands_merges_the_earlier_points():
    from perf.concurrency_sweep import merge_earlier

    settings = {"device": "cuda", "dtype": "bfloat16", "max_tokens": 64, "repeats": 3}
    earlier = {**settings, "header": {"commit": "abc1234", "date": "d", "command": "c"}, "warmup_passes": {"1": 3, "16": 1},
               "methods": {"ar": {"1": runs(10.0), "2": runs(20.0), "16": runs(99.0)},
                           "auto": {"1": runs(11.0), "2": runs(19.0), "16": runs(98.0)}}}
    result = {**settings, "methods": {"ar": {"16": runs(160.0)}, "auto": {"16": runs(170.0)}}}
    assert merge_earlier(result, earlier, [16, 32]) == [1, 2]
    assert sorted(result["methods"]["ar"], key=int) == ["1", "2", "16"]
    assert result["methods"]["auto"]["16"]["tokens_per_s"] == 170.0     # this run's point, not the earlier one's
    assert paired_ratios(result["methods"])["2"]["over_ar"] == pytest.approx([19 / 20])
    assert result["merged"] == {"levels": [1, 2], "header": earlier["header"]}
    assert result["warmup_passes"] == {"1": 3}   # the earlier run's warm-up of the points taken, not of 16
    with pytest.raises(SystemExit, match="max_tokens"):
        merge_earlier({**result, "max_tokens": 32}, earlier, [16])
    with pytest.raises(SystemExit, match="measured"):
        merge_earlier({**settings, "methods": {"ar": {}}}, earlier, [16])


def test_runs_whose_engine_held_few_of_the_streams_are_listed():
    def run(tokens, batch, engine_ttft=None):
        return {"tokens_per_s": tokens, "ttft_ms_p50": 183.0, "stages": {"mean_batch": batch},
                **({"engine_ttft_ms": engine_ttft} if engine_ttft is not None else {})}
    methods = {"ar": {"32": median_run([run(12000, 32.0), run(12400, 29.0)])},
               "auto": {"32": median_run([run(11900, 31.9, 50.2), run(6978, 14.0, 13.1)]),
                        "16": median_run([run(8000, 16.0)])}}
    assert idle_runs(methods, [16, 32]) == [
        "auto c=32 run 2: 6978 tok/s, mean batch 14.0, time to first token p50 183 ms (the engine's mean 13.1)"]
    assert idle_runs({"ar": {"8": median_run([run(100, 8.0)])}}, [8, 16]) == []
    steps = {"postprocessing": {"queue_ms": 26.73, "compute_ms": 0.64, "executions": 21504},
             "preprocessing": {"queue_ms": 0.41, "compute_ms": 0.75, "executions": 336}}
    assert idle_runs({"auto": {"16": median_run([{**run(6814, 11.7, 6.1), **steps}])}}, [16]) == [
        "auto c=16 run 1: 6814 tok/s, mean batch 11.7, time to first token p50 183 ms (the engine's mean 6.1), "
        "preprocessing 0.41 / 0.75 ms, postprocessing 26.73 / 0.64 ms"]


def test_wall_ms_per_round_is_the_runs_time_over_its_rounds():
    # 976 requests of 64 tokens at 10458.5 tok/s in 2022 batch rounds (an H200 `ar` run at c=32): 2.95 ms a round
    run = {"tokens_per_s": 10458.5, "num_requests": 976, "stages": {"batch_rounds": 2022.0, "mean_batch": 31.4}}
    assert wall_ms_per_round(run, 64) == pytest.approx(2.954, abs=1e-3)
    assert wall_ms_per_round({**run, "stages": {"mean_batch": 31.4}}, 64) is None   # no counters: nothing to divide by
    assert wall_ms_per_round({"tokens_per_s": 0.0, "num_requests": 4, "stages": {"batch_rounds": 3}}, 64) is None


def test_a_runs_stalls_and_garbage_collection_read_as_counts_and_ms():
    run = {"tokens_per_s": 1.0, "stalls": {"slow_steps": 2.0, "slow_step_s": 1.3, "gc_s": 0.95, "full_gcs": 1.0}}
    assert stalls_cell(run) == "2 / 1300; gc 950 / 1"
    assert stalls_cell({"tokens_per_s": 1.0}) == "-"   # a run of a server without the counters
    run["stalls"]["dynamic"] = 3.0
    assert stalls_cell(run) == "2 / 1300; gc 950 / 1; dynamic 3"


def test_turns_give_an_interval_of_the_ratio_that_holds_one_only_where_they_cannot_tell_the_methods_apart():
    import math

    from perf.concurrency_sweep import turn_interval

    assert turn_interval([1.0]) is None   # one turn: no spread to judge by
    same = turn_interval([0.9, 1.1, 1.0])
    assert same["mean"] == pytest.approx((0.9 * 1.1) ** (1 / 3)) and same["low"] < 1.0 < same["high"]
    slower = turn_interval([0.90, 0.91, 0.89, 0.90])   # four turns 10% slower, little spread: told apart
    assert slower["high"] < 1.0 and slower["turns"] == 4
    # Student's t on the logs: 3 degrees of freedom, 3.182
    logs = [math.log(r) for r in (0.90, 0.91, 0.89, 0.90)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert slower["low"] == pytest.approx(math.exp(mean - 3.182 * sd / 2))
    # between two tabled degrees of freedom the smaller one's (wider) quantile: 13 turns take 12's
    from perf.concurrency_sweep import T95
    ratios = [0.95, 1.05] * 6 + [1.0]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 13
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 12)
    assert turn_interval(ratios)["high"] == pytest.approx(math.exp(mean + T95[12] * sd / math.sqrt(13)))


def test_with_the_control_auto_is_also_compared_with_both_ar_runs_of_its_turn():
    from perf.concurrency_sweep import CONTROL, control_ratios

    methods = {"ar": {"4": runs(100.0, 200.0)}, CONTROL: {"4": runs(400.0, 50.0)}, "auto": {"4": runs(200.0, 100.0)}}
    row = paired_ratios(methods)["4"]
    assert row["over_both_ar"] == pytest.approx([1.0, 1.0])   # auto / sqrt(ar x ar-again), turn by turn
    assert row["over_ar"] == pytest.approx([2.0, 0.5])
    assert row["over_both_ar_interval"]["mean"] == pytest.approx(1.0)
    control = control_ratios(methods)["4"]
    assert "over_both_ar" not in control and control["over_ar_interval"]["mean"] == pytest.approx(1.0)   # 4 and 1/4
    without = paired_ratios({"ar": methods["ar"], "auto": methods["auto"]})["4"]
    assert "over_both_ar" not in without and without["over_ar_interval"]["mean"] == pytest.approx(1.0)


def test_turn_intervals_reads_sweeps_already_run():
    from perf.concurrency_sweep import CONTROL, control_ratios
    from perf.turn_intervals import intervals

    sweep = {"methods": {"ar": {"8": runs(100.0, 110.0, 90.0)}, CONTROL: {"8": runs(101.0, 108.0, 93.0)},
                         "auto": {"8": runs(99.0, 111.0, 88.0)}, "dflash": {"8": runs(50.0, 55.0, 45.0)}}}
    row = intervals(sweep)["8"]
    assert row["turns"] == 3
    assert row["auto_over_ar"]["mean"] == pytest.approx((0.99 * 111 / 110 * 88 / 90) ** (1 / 3))
    assert row["control_over_ar"]["mean"] == pytest.approx((1.01 * 108 / 110 * 93 / 90) ** (1 / 3))
    assert row["auto_over_both_ar"]["low"] < 1.0 < row["auto_over_both_ar"]["high"]
    assert intervals({"methods": {"ar": {"1": runs(1.0, 2.0)}, "auto": {"1": runs(1.0, 2.0)}}})["1"]["control_over_ar"] is None
    assert control_ratios({"ar": {"1": runs(1.0, 2.0)}}) == {}   # no control measured: nothing to compare
    assert row["best"] == ["ar"] and row["auto_over_best"]["mean"] == pytest.approx(row["auto_over_ar"]["mean"])


def test_the_sending_threads_time_reads_per_second_of_the_run():
    before = {SENDER["send_s"]: 1.0, SENDER["check_s"]: 0.5, SENDER["checks"]: 100.0, SENDER["responses"]: 1000.0,
              SENDER["publish_s"]: 2.0}
    after = {SENDER["send_s"]: 1.6, SENDER["check_s"]: 0.6, SENDER["checks"]: 500.0, SENDER["responses"]: 3000.0,
             SENDER["publish_s"]: 2.04}
    rates = sender_rates(before, after, 2.0)   # a 2 s run: 2000 responses in 0.6 s, 400 asks in 0.1 s, metrics 40 ms
    assert rates == pytest.approx({"send_ms_per_s": 300.0, "responses_per_s": 1000.0, "send_ms": 0.3,
                                   "checks_per_s": 200.0, "check_ms_per_s": 50.0, "check_ms": 0.25,
                                   "publish_ms_per_s": 20.0})
    assert sender_cell({"sender": rates}) == "300 (1000, 0.30) / 200 / 50 (0.25); 20"
    assert sender_rates(before, {SENDER["send_s"]: 1.6}, 2.0) is None and sender_cell({}) == "-"   # not exported
    table = level_table({"methods": {"ar": {"16": {"sender": rates}, "32": {}}}}, [16, 32], sender_cell, "caption")
    assert table == ["", "caption", "", "| method | c=16 | c=32 |", "|---|---|---|",
                     "| ar | 300 (1000, 0.30) / 200 / 50 (0.25); 20 | - |"]


def test_ar_through_the_generation_model_alone_is_compared_with_ar_not_with_auto():
    from perf.concurrency_sweep import ALONE, GENERATION_MODEL, METHODS, control_ratios, model_of

    assert [model_of(m) for m in METHODS if m[2] in ("ar", ALONE)] == ["ensemble", GENERATION_MODEL]
    methods = {"ar": {"4": runs(100.0, 200.0)}, ALONE: {"4": runs(130.0, 210.0)}, "auto": {"4": runs(110.0, 190.0)}}
    assert paired_ratios(methods)["4"]["best_per_run"] == ["ar", "ar"]   # another route, not another method
    assert control_ratios(methods, ALONE)["4"]["over_ar"] == pytest.approx([1.3, 1.05])


def runs_queued(tokens_per_s, queues):
    """A point's runs with the postprocessing step's queue ms an execution of each (what episode_turns reads)."""
    return median_run([{"tokens_per_s": v, "postprocessing": {"queue_ms": q}} for v, q in zip(tokens_per_s, queues)])


def test_a_turn_whose_postprocessing_queued_far_over_the_points_median_is_a_host_episode_left_out_whole():
    from perf.concurrency_sweep import CONTROL, episode_turns, steady_ratios, steady_turns

    methods = {"ar": {"16": runs_queued([100.0, 60.0, 100.0, 102.0], [0.3, 20.0, 0.4, 0.3])},
               CONTROL: {"16": runs_queued([101.0, 99.0, 98.0, 100.0], [0.3, 0.5, 0.3, 0.3])},
               "auto": {"16": runs_queued([99.0, 98.0, 97.0, 100.0], [0.4, 0.3, 1.5, 0.3])}}
    # 20 ms is over 3x the median run's 0.3 ms and over 2 ms: turn 2 is left out; 1.5 ms is under the 2 ms floor
    assert episode_turns(methods, "16") == [1]
    steady, dropped = steady_turns(methods)
    assert dropped == {"16": [2]}
    assert all(steady[name]["16"]["runs_tokens_per_s"] == [v for i, v in enumerate(methods[name]["16"]["runs_tokens_per_s"])
                                                            if i != 1] for name in methods)   # every method's run of it
    row = steady_ratios(methods)["16"]
    assert row["episodes"] == [2] and row["turns"] == 3
    assert row["auto_over_ar"]["mean"] == pytest.approx((0.99 * 0.97 * 100 / 102) ** (1 / 3))
    assert row["control_over_ar"]["mean"] == pytest.approx((1.01 * 0.98 * 100 / 102) ** (1 / 3))
    # with the episode's turn the control's interval is far wider than without it
    wide = paired_ratios({n: methods[n] for n in ("ar", CONTROL)}, CONTROL)["16"]["over_ar_interval"]
    assert wide["high"] - wide["low"] > 5 * (row["control_over_ar"]["high"] - row["control_over_ar"]["low"])


def test_an_episode_is_over_the_factor_times_the_points_median_not_only_over_the_floor():
    from perf.concurrency_sweep import CONTROL, episode_turns, steady_ratios

    # a point whose runs queue ~1 ms: 2.5 ms is over the 2 ms floor but under 3x the median; 3.5 and 4 ms are over both
    methods = {"ar": {"8": runs_queued([100.0, 100.0, 100.0, 100.0, 100.0], [1.0, 2.5, 1.1, 3.5, 0.9])},
               CONTROL: {"8": runs_queued([100.0, 100.0, 100.0, 100.0, 100.0], [1.0, 1.0, 1.2, 1.0, 4.0])},
               "auto": {"8": runs_queued([99.0, 99.0, 99.0, 99.0, 99.0], [1.0, 1.1, 0.9, 1.0, 1.0])}}
    assert episode_turns(methods, "8") == [3, 4]
    row = steady_ratios(methods)["8"]
    assert row["episodes"] == [4, 5] and row["turns"] == 3   # two turns left out of five
    # a run without postprocessing executions (the generation model alone) counts for nothing, whatever it reads
    alone = {**methods, "ar-alone": {"8": median_run([{"tokens_per_s": 120.0, "postprocessing": {"executions": 0,
                                                                                              "queue_ms": 50.0}}] * 5)}}
    assert episode_turns(alone, "8") == [3, 4]


def test_a_point_without_episodes_or_without_the_queue_statistics_keeps_every_turn():
    from perf.concurrency_sweep import episode_turns, steady_ratios

    calm = {"ar": {"4": runs_queued([100.0, 101.0], [0.3, 1.9])}, "auto": {"4": runs_queued([99.0, 100.0], [0.3, 0.3])}}
    assert episode_turns(calm, "4") == [] and steady_ratios(calm) == {}
    older = {"ar": {"4": runs(100.0, 101.0)}, "auto": {"4": runs(99.0, 100.0)}}   # no postprocessing statistics
    assert episode_turns(older, "4") == [] and steady_ratios(older) == {}


def test_turn_intervals_pools_every_points_turns_with_and_without_episodes():
    from perf.concurrency_sweep import CONTROL
    from perf.turn_intervals import intervals, pooled_turns

    first = {"ar": {"1": runs_queued([100.0, 100.0], [0.3, 0.3])}, CONTROL: {"1": runs_queued([100.0, 100.0], [0.3, 0.3])},
             "auto": {"1": runs_queued([98.0, 99.0], [0.3, 0.3])}}
    second = {"ar": {"32": runs_queued([100.0, 50.0, 100.0], [0.4, 39.0, 0.4])},
              CONTROL: {"32": runs_queued([100.0, 100.0, 100.0], [0.4, 0.4, 0.4])},
              "auto": {"32": runs_queued([97.0, 96.0, 98.0], [0.4, 0.4, 0.4])}}
    pooled = pooled_turns([first, second])
    assert pooled["all"]["n"] == 5 and pooled["steady"]["n"] == 4
    expected = [0.98, 0.99, 0.97, 0.98]   # against ar and ar-again both 100
    assert pooled["steady"]["auto_over_both_ar"]["mean"] == pytest.approx(math.prod(expected) ** (1 / 4))
    assert pooled["steady"]["control_over_ar"]["mean"] == pytest.approx(1.0)
    assert pooled["all"]["control_over_ar"]["mean"] > 1.1   # the episode's turn: ar-again / ar = 2
    assert intervals({"methods": second})["32"]["steady"]["episodes"] == [2]
    assert intervals({"methods": first})["1"]["steady"] is None
    # a split sweep's earlier part given beside the merged file: its points count once
    merged = {name: {**first[name], **second[name]} for name in first}
    assert pooled_turns([first, merged])["all"]["n"] == 5 and pooled_turns([first, merged])["steady"]["n"] == 4
    assert pooled_turns([{"ar": first["ar"], "auto": first["auto"]}])["all"]["n"] == 0   # no control measured
    # a point the control lacks, or whose runs differ in number (a run cut off), is left out, not cut to fit
    lacking = {**first, "auto": {**first["auto"], "8": runs_queued([99.0], [0.3])}}
    uneven = {**first, CONTROL: {"1": runs_queued([100.0], [0.3])}}
    assert pooled_turns([lacking])["all"]["n"] == 2 and pooled_turns([uneven])["all"]["n"] == 0


def test_turn_intervals_runs_as_a_script_and_writes_its_tables(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from perf.concurrency_sweep import CONTROL

    sweep = {"methods": {"ar": {"32": runs_queued([100.0, 50.0, 100.0], [0.4, 39.0, 0.4])},
                         CONTROL: {"32": runs_queued([100.0, 100.0, 101.0], [0.4, 0.4, 0.4])},
                         "auto": {"32": runs_queued([97.0, 96.0, 98.0], [0.4, 0.4, 0.4])}}}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(root / "perf/turn_intervals.py"), str(tmp_path / "sweep.json"), "--out",
                    str(tmp_path), "--name", "ti"], check=True, capture_output=True, cwd=root)
    text = (tmp_path / "ti.md").read_text()
    assert "| sweep | 32 | 2 | 2 |" in text and "| without host episodes | 2 |" in text
