"""How fast each CPU of this machine runs host work, and how much that drifts: the noise floor of host-bound timings.

A decode step of a small model is host-bound (Python, launches, synchronisation), so its time follows the speed of
the CPU its thread runs on. On the GPU machine that speed differed by up to ~1.8x between CPUs and between moments
(stub_probe runs of the same probe in two processes gave either ~7.5 or ~13 ms per loop). This pins the calling
thread to each CPU in turn, `--rounds` times, and times a pure-Python loop and small CPU torch ops there.

    python perf/host_speed.py --rounds 3 --name host_speed_h200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, header, write_results  # noqa: E402
from perf.probe_workload import cpu_ops_us, python_loop_ms  # noqa: E402


def measure(rounds: int, repeats: int) -> list[dict[int, dict[str, float]]]:
    """[round][cpu] = {"python_loop_ms", "torch_cpu_ops_us"}, each the median of `repeats` runs on that CPU."""
    import torch

    x = torch.ones(64)
    cpus = sorted(os.sched_getaffinity(0))
    result = []
    try:
        for _ in range(rounds):
            row = {}
            for cpu in cpus:
                os.sched_setaffinity(0, {cpu})
                row[cpu] = {"python_loop_ms": statistics.median(python_loop_ms() for _ in range(repeats)),
                            "torch_cpu_ops_us": statistics.median(cpu_ops_us(x) for _ in range(repeats))}
            result.append(row)
    finally:
        os.sched_setaffinity(0, set(cpus))
    return result


def summary(rounds: list[dict[int, dict[str, float]]]) -> dict:
    out = {}
    for key in ("python_loop_ms", "torch_cpu_ops_us"):
        values = [v[key] for row in rounds for v in row.values()]
        out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values),
                    "max_over_min": max(values) / min(values)}
    return out


def table(result: dict) -> str:
    rounds = result["rounds"]
    cpus = sorted(rounds[0], key=int)
    lines = ["Per CPU (pinned), python loop ms / torch CPU op us:", "",
             "| round | " + " | ".join(f"cpu {c}" for c in cpus) + " |", "|---|" + "---|" * len(cpus)]
    for i, row in enumerate(rounds):
        lines.append(f"| {i} | " + " | ".join(f"{row[c]['python_loop_ms']:.1f} / {row[c]['torch_cpu_ops_us']:.1f}"
                                              for c in cpus) + " |")
    lines += ["", "| measure | min | median | max | max / min |", "|---|---|---|---|---|"]
    for key, s in result["summary"].items():
        lines.append(f"| {key} | {s['min']:.2f} | {s['median']:.2f} | {s['max']:.2f} | {s['max_over_min']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9, help="each cell is the median of this many")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="host_speed_cpu")
    args = parser.parse_args(argv)
    rounds = measure(args.rounds, args.repeats)
    result = {"header": header(), "rounds": [{str(c): v for c, v in row.items()} for row in rounds],
              "summary": summary(rounds)}
    write_results(Path(args.out), args.name, result, table(result))
    return result


if __name__ == "__main__":
    main()
