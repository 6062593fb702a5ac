"""Whether the engine thread's own Python slows while the outbox thread works in its device waits, and whether draining
(DDTREE_OUTBOX_DRAIN=1: the engine thread runs those calls itself while the device is busy) takes that away.

A stand-in for the engine in its child process, no model and no GPU (the mechanism, not the engine's numbers): each
round is host work (Python, --host-us in two halves), a "draft" wait (--draft-wait-us: the device busy, the thread
asleep with the GIL released), the other half of the host work, a "verify" wait (--verify-wait-us), then the round's
responses put on a deferring Outbox as GenerationService does; each response is a call that does --call-us of Python
(the text) and sends a response-like message through a socket pair that another process drains (the child's pipe).
The modes, in turns:

- `none`: no responses (the engine's loop alone);
- `thread`: the outbox thread runs them once the next wait opens the gate (the default);
- `drain`: Outbox.drain, the engine thread runs them as the wait starts while the device is "busy", the rest going
  to the outbox thread.

Per mode: ms a round, the host halves' time (us a round: what a concurrent Python thread costs them), and how late the
engine thread resumed after each wait's end (us: the GIL taken back from the outbox thread, beside the sleep's own
lateness, which `none` shows).

    python perf/drain_probe.py --name drain_probe_cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.serving import DeviceWaitGate, Outbox  # noqa: E402
from perf.common import ROOT, header, write_results  # noqa: E402
from perf.service_probe import _Drained  # noqa: E402

MODES = ("none", "thread", "drain")


def python_work(us: float, per_us: float) -> int:
    """About `us` microseconds of interpreted work (dict and list operations, as the engine's bookkeeping)."""
    total, row = 0, {}
    for i in range(int(us * per_us)):
        row[i & 63] = i
        total += len(row)
    return total


def calibrate() -> float:
    """Iterations of python_work's loop per microsecond on this machine (the best of a few tries)."""
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        python_work(20_000, 1.0)
        best = max(best, 20_000 / (1e6 * (time.perf_counter() - start)))
    return best


class Loop:
    """One mode's stand-in engine thread and its outbox."""

    def __init__(self, mode: str, args: argparse.Namespace, per_us: float, drained: _Drained) -> None:
        self.mode, self.args, self.per_us, self.link = mode, args, per_us, drained.link
        self.gate = DeviceWaitGate()
        self.outbox = Outbox(gate=self.gate, defer=True, drain=mode == "drain")
        self.gate.on_open = self.outbox.flush
        self.host_s = self.late_s = 0.0
        self.waits = self.sent = self.sent_by_engine = 0

    def send(self, request: int, round_index: int) -> None:
        text = f"token {round_index} " * (python_work(self.args.call_us, self.per_us) % 4 + 4)
        self.link.send(("out", request, {"text_output": text, "num_output_tokens": 3, "finish_reason": None}, False))
        self.sent += 1
        self.sent_by_engine += threading.current_thread().name == "ddtree-engine"

    def wait(self, us: float) -> None:
        deadline = time.perf_counter() + us / 1e6
        self.outbox.drain(lambda: lambda: time.perf_counter() >= deadline)
        self.gate.set()
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self.late_s += time.perf_counter() - deadline
        self.waits += 1
        self.gate.clear()

    def host(self, us: float) -> None:
        start = time.perf_counter()
        python_work(us, self.per_us)
        self.host_s += time.perf_counter() - start

    def run(self, rounds: int) -> float:
        """The loop on a thread of its own (as the engine's); its seconds."""
        seconds = [0.0]

        def loop() -> None:
            self.outbox.owner = threading.get_ident()
            start = time.perf_counter()
            for r in range(rounds):
                self.host(self.args.host_us / 2)
                self.wait(self.args.draft_wait_us)
                self.host(self.args.host_us / 2)
                self.wait(self.args.verify_wait_us)
                if self.mode != "none":
                    for request in range(self.args.responses):
                        self.outbox.put(self.send, request, r)
            seconds[0] = time.perf_counter() - start
            self.outbox.owner = None

        worker = threading.Thread(target=loop, name="ddtree-engine")
        worker.start()
        worker.join()
        self.outbox.close(10.0)
        return seconds[0]


def table(result: dict) -> str:
    lines = ["Medians over the turns (us unless marked; host: the two halves' time a round, "
             f"{result['host_us']} us of work asked; late: after each wait's end; vs none: ms a round over `none`'s in "
             "the same turn; by the engine: the share of the responses sent from the engine thread):", "",
             "| mode | ms a round | vs none | host | late a wait | by the engine |", "|---|---|---|---|---|---|"]
    for mode, s in result["summary"].items():
        lines.append(f"| {mode} | {s['round_ms']:.3f} | {s['vs_none']:.3f} | {s['host_us']:.1f} | {s['late_us']:.1f} | "
                     f"{s['by_engine']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--host-us", type=float, default=400.0, help="the round's host work (the drafting modes' "
                        "draft and host stages on the H100: ~0.45 ms)")
    parser.add_argument("--draft-wait-us", type=float, default=300.0)
    parser.add_argument("--verify-wait-us", type=float, default=1500.0)
    parser.add_argument("--responses", type=int, default=1, help="responses a round (batch 1: one)")
    parser.add_argument("--call-us", type=float, default=60.0, help="a response's Python (its text) before its send")
    parser.add_argument("--out", default=str(ROOT / "perf/results"))
    parser.add_argument("--name", default="drain_probe_cpu")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    per_us = calibrate()
    drained = _Drained()
    turns = []
    try:
        for turn in range(args.turns):
            order = modes[turn % len(modes):] + modes[: turn % len(modes)]
            measured = {}
            for mode in order:
                loop = Loop(mode, args, per_us, drained)
                seconds = loop.run(args.rounds)
                measured[mode] = {"round_ms": 1e3 * seconds / args.rounds, "host_us": 1e6 * loop.host_s / args.rounds,
                                  "late_us": 1e6 * loop.late_s / max(loop.waits, 1), "sent": loop.sent,
                                  "sent_by_engine": loop.sent_by_engine}
            turns.append(measured)
    finally:
        drained.close()
    summary = {}
    for mode in modes:
        pick = lambda field: statistics.median(t[mode][field] for t in turns)  # noqa: E731
        vs = [t[mode]["round_ms"] / t["none"]["round_ms"] for t in turns] if "none" in modes else [float("nan")]
        summary[mode] = {"round_ms": pick("round_ms"), "host_us": pick("host_us"), "late_us": pick("late_us"),
                         "vs_none": statistics.median(vs),
                         "by_engine": sum(t[mode]["sent_by_engine"] for t in turns) / max(sum(t[mode]["sent"] for t in turns), 1)}
    result = {"header": header(), "args": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
              "host_us": args.host_us, "iterations_per_us": per_us, "turns": turns, "summary": summary}
    write_results(Path(args.out), args.name, result, table(result))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
