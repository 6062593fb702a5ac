"""`auto` against the fixed methods as intervals, from concurrency sweeps already run (their JSON): per file and
concurrency, the geometric mean of the per-turn ratios and its 95% interval (perf/concurrency_sweep.py's turn_interval)
for `auto` / the best other method of each turn (the A/A control is none), `auto` / `ar`, `auto` / both `ar` runs of
its turn where the sweep ran the A/A control, and the control / `ar`. A sweep's markdown gives the median and the worst
turn; this asks what its turns say about the ratio itself, and whether they can tell `auto` from `ar` at all. Each
file's own commit and machine are listed beside its rows.

    python perf/turn_intervals.py perf/results/concurrency_h100_robust.json perf/results/concurrency_h100_robust_high.json \\
        --name turn_intervals_h100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402
from perf.concurrency_sweep import (  # noqa: E402
    EPISODE_FACTOR,
    EPISODE_FLOOR_MS,
    control_ratios,
    interval_cell,
    paired_ratios,
    steady_ratios,
    steady_turns,
    turn_interval,
)


def intervals(sweep: dict) -> dict[str, dict]:
    """Per concurrency of one sweep's result: its turns, and the intervals of auto / the best other method of each turn
    (and which methods those were), auto / ar, auto / both ar runs and the control / ar (those it measured)."""
    methods = sweep["methods"]
    paired = paired_ratios(methods)
    control = control_ratios(methods)
    steady = steady_ratios(methods)
    out = {}
    for level in sorted(set(paired) | set(control), key=int):
        row, ctl = paired.get(level, {}), control.get(level, {})
        out[level] = {"turns": len(row.get("over_ar", ctl.get("over_ar", []))),
                      "auto_over_best": row.get("over_best_interval"), "best": sorted(set(row.get("best_per_run", []))),
                      "auto_over_ar": row.get("over_ar_interval"),
                      "auto_over_both_ar": row.get("over_both_ar_interval"),
                      "control_over_ar": ctl.get("over_ar_interval"),
                      "steady": steady.get(level)}   # without the turns that met a host episode, where any did
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", nargs="+", help="concurrency_sweep.py result JSON files")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="turn_intervals")
    args = parser.parse_args()
    result = {"header": header(), "sweeps": {}}
    rows = ["Per sweep and concurrency: the geometric mean of the per-turn ratios [its 95% interval] (an interval holding "
            "1.000 cannot tell the two apart at that many turns; the A/A control's is how wide that is for two identical "
            "methods).", "",
            "| sweep (commit, GPU) | c | turns | auto / best other (which) | auto / ar | auto / both ar runs | ar-again / ar |",
            "|---|---|---|---|---|---|---|"]
    sweeps = [json.loads(Path(path).read_text()) for path in args.sweeps]
    for path, sweep in zip(args.sweeps, sweeps):
        meta = sweep.get("header", {})
        name = Path(path).stem
        gpu = meta.get("machine", {}).get("gpu", "CPU")
        levels = intervals(sweep)
        result["sweeps"][name] = {"commit": meta.get("commit"), "machine": meta.get("machine"), "levels": levels}
        for level, row in levels.items():
            rows.append(f"| {name} ({meta.get('commit', '?')}, {gpu}) | {level} | {row['turns']} | "
                        f"{interval_cell(row['auto_over_best'])} ({', '.join(row['best']) or '-'}) | "
                        f"{interval_cell(row['auto_over_ar'])} | {interval_cell(row['auto_over_both_ar'])} | "
                        f"{interval_cell(row['control_over_ar'])} |")
    steady = [(name, level, row["steady"]) for name, sweep in result["sweeps"].items()
              for level, row in sweep["levels"].items() if row["steady"]]
    if steady:
        rows += ["", "The same without the turns that met a host episode (concurrency_sweep.episode_turns: a run whose "
                 f"postprocessing step queued over {EPISODE_FACTOR:g}x the point's median run's and over {EPISODE_FLOOR_MS:g} ms "
                 "an execution; the whole turn left out), where any did:", "",
                 "| sweep | c | turns left out | turns | auto / ar | auto / both ar runs | ar-again / ar |",
                 "|---|---|---|---|---|---|---|"]
        rows += [f"| {name} | {level} | {', '.join(map(str, row['episodes']))} | {row['turns']} | "
                 f"{interval_cell(row['auto_over_ar'])} | {interval_cell(row['auto_over_both_ar'])} | "
                 f"{interval_cell(row['control_over_ar'])} |" for name, level, row in steady]
    pooled = pooled_turns([sweep["methods"] for sweep in sweeps])
    result["pooled"] = pooled
    if pooled["all"]["auto_over_both_ar"]:
        rows += ["", "Every point's turns pooled (one sample a turn, whatever its concurrency: a deficit common to the "
                 "points that each point's turns are too few to show):", "",
                 "| turns | n | auto / both ar runs | ar-again / ar |", "|---|---|---|---|"]
        rows += [f"| {label} | {pooled[key]['n']} | {interval_cell(pooled[key]['auto_over_both_ar'])} | "
                 f"{interval_cell(pooled[key]['control_over_ar'])} |"
                 for key, label in (("all", "all"), ("steady", "without host episodes"))]
    write_results(Path(args.out), args.name, result, "\n".join(rows))


def pooled_turns(sweeps: list[dict[str, dict[str, dict]]]) -> dict[str, dict]:
    """auto / both ar runs of its turn and the A/A control / ar (paired_ratios' and control_ratios' per-turn ratios)
    over every turn of every point of these sweeps' methods, and over those without a host episode (steady_turns).
    Points without the three methods, or whose run lists differ in length, are left out; a point met twice (a sweep
    split with --merge, given with its earlier part) counts once."""
    out = {}
    for key in ("all", "steady"):
        both, control, seen = [], [], set()
        for methods in sweeps:
            if key == "steady":
                methods = steady_turns(methods)[0]
            paired, controls = paired_ratios(methods), control_ratios(methods)
            for level, row in paired.items():
                ratios, again = row.get("over_both_ar"), controls.get(level, {}).get("over_ar")
                # over_both_ar is there only with the control's runs as many as auto's; ar's are checked here
                runs = len(methods["auto"][level]["runs_tokens_per_s"])
                if ratios is None or len(methods["ar"][level]["runs_tokens_per_s"]) != runs:
                    continue
                point = (level, tuple(ratios), tuple(again))
                if point not in seen:
                    seen.add(point)
                    both += ratios
                    control += again
        out[key] = {"n": len(both), "auto_over_both_ar": turn_interval(both), "control_over_ar": turn_interval(control)}
    return out

if __name__ == "__main__":
    main()
