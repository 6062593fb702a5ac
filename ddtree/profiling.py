"""Profile a window of the serving loop's steps (a diagnostic, off unless DDTREE_PROFILE is set).

DDTREE_PROFILE=<dir>[:<skip>[:<steps>]]: after `skip` engine steps (default 200), record `steps` (default 50) with the
PyTorch profiler (host ops and, on CUDA, kernels) and write their summary tables to <dir>/profile_<pid>.txt. Inside
Triton the model's process inherits the server's environment, so the same setting profiles the stub and an in-process
run (perf/serve_overhead.py) side by side.

DDTREE_CPROFILE=<dir>[:<skip>[:<steps>[:<every>]]]: the serving loop's Python functions under cProfile for `steps`
engine steps (default 200) after `skip` (default 200), again every `every` steps (default 0: once; on Python 3.12
cProfile is built on sys.monitoring and sees every thread's calls, the outbox's and the stub's too), each window to
<dir>/cprofile_<pid>_<window>.txt, headed by its wall ms a step and the modes of the requests it served (so one server
that serves `ar`, then `auto`, profiles both: where the stub's host time goes, by function).

DDTREE_AUTO_TRACE=<dir>: every round mode `auto` runs (ArmSelector.record: the arm credited, the batch size, tokens,
seconds, whether it was a catch-up) as a JSON line in <dir>/auto_trace_<pid>.jsonl (ArmTrace); perf/auto_trace.py
--summarise reads it, split into runs at idle gaps (a sweep's perf_analyzer runs)."""

from __future__ import annotations

import cProfile
import io
import json
import logging
import os
import pstats
import time
from collections import Counter
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def window_spec(variable: str, spec: str | None, names: tuple[str, ...], defaults: tuple[int, ...]
                ) -> tuple[Path | None, tuple[int, ...]]:
    """A '<dir>[:<n>[:<n>...]]' setting (spec, else the environment's `variable`): its directory (None: unset, or
    mistyped, which is logged: a diagnostic's typo must not stop the model from loading) and its whole numbers, the
    defaults where left out."""
    spec = os.environ.get(variable, "") if spec is None else spec
    if not spec:
        return None, defaults
    parts = spec.split(":")
    try:
        numbers = tuple(int(part) for part in parts[1 : 1 + len(defaults)])
    except ValueError:
        expected = "<dir>" + "".join(f"[:<{name}>" for name in names) + "]" * len(names)
        logger.error("%s=%r: expected %s with whole numbers; not profiling", variable, spec, expected)
        return None, defaults
    return Path(parts[0]), numbers + defaults[len(numbers):]


class StepProfiler:
    def __init__(self, spec: str | None = None) -> None:
        self.directory, (self.skip, steps) = window_spec("DDTREE_PROFILE", spec, ("skip", "steps"), (200, 50))
        self.steps = max(steps, 1)
        self.count = 0
        self._profile = None
        self._start = 0.0

    def before_step(self) -> None:
        if self.directory is None or self.count != self.skip:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        self._start = time.perf_counter()

    def after_step(self) -> None:
        if self.directory is None:
            return
        self.count += 1
        if self._profile is None or self.count != self.skip + self.steps:
            return
        seconds = time.perf_counter() - self._start
        profile, self._profile = self._profile, None
        try:   # never a reason for the serving loop to fail
            profile.__exit__(None, None, None)
            events = profile.key_averages()
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"profile_{os.getpid()}.txt"
            text = [f"{self.steps} steps after {self.skip}: {1e3 * seconds / self.steps:.3f} ms per step (wall)",
                    events.table(sort_by="self_cpu_time_total", row_limit=40)]
            if torch.cuda.is_available():
                text.append(events.table(sort_by="self_device_time_total", row_limit=25))
            path.write_text("\n\n".join(text))
            logger.warning("profile of %d steps written to %s", self.steps, path)
        except Exception:
            logger.exception("DDTREE_PROFILE: could not write the profile to %s", self.directory)


class ArmTrace:
    """Every record() of an ArmSelector: (arm credited, batch size, tokens, seconds, catch-up, monotonic time) kept in
    `rows`, or with a path appended to it as JSON lines instead (a served model's trace would otherwise grow in
    memory). Wraps the selector's record in place."""

    FIELDS = ("arm", "num_seqs", "tokens", "seconds", "catch_up", "time")

    def __init__(self, selector, path: Path | str | None = None) -> None:
        self.rows: list[tuple] = []
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)   # noqa: SIM115 (open for the engine's life; a line a round)
        record = selector.record

        def traced(num_seqs, arm, tokens, seconds, **kw):
            catch_up = selector.catching_up   # record() clears it
            ran = record(num_seqs, arm, tokens, seconds, **kw)
            row = (ran.name, num_seqs, tokens, seconds, catch_up, time.monotonic())
            if self._file is None:
                self.rows.append(row)
            else:
                try:   # a diagnostic never stops a round
                    self._file.write(json.dumps(dict(zip(self.FIELDS, row))) + "\n")
                except (OSError, ValueError):
                    logger.exception("DDTREE_AUTO_TRACE: could not write; tracing stops")
                    self._file = None
            return ran

        selector.record = traced

    @classmethod
    def from_env(cls, selector) -> ArmTrace | None:
        directory = os.environ.get("DDTREE_AUTO_TRACE", "")
        if not directory:
            return None
        try:
            return cls(selector, Path(directory) / f"auto_trace_{os.getpid()}.jsonl")
        except OSError:
            logger.exception("DDTREE_AUTO_TRACE=%r: cannot write there; not tracing", directory)
            return None


class CProfileWindows:
    """DDTREE_CPROFILE's windows (module doc). describe() names what a step served (called after each profiled one)."""

    def __init__(self, spec: str | None = None, describe=None) -> None:
        self.directory, (self.skip, steps, every) = window_spec("DDTREE_CPROFILE", spec, ("skip", "steps", "every"),
                                                               (200, 200, 0))
        self.describe = describe
        self.steps, self.every = max(steps, 1), max(every, 0)
        if self.every and self.every < self.steps:
            self.every = self.steps   # windows never overlap
        self.count = 0     # engine steps seen
        self.windows = 0   # windows written
        self._profile: cProfile.Profile | None = None
        self._done = 0     # steps of the open window
        self._start = 0.0
        self._served: Counter = Counter()

    def before_step(self) -> None:
        if self.directory is None or self._profile is not None or self.count < self.skip:
            return
        if self.count != self.skip and not (self.every and (self.count - self.skip) % self.every == 0):
            return
        self._profile, self._served, self._done = cProfile.Profile(), Counter(), 0
        self._start = time.perf_counter()
        self._profile.enable()

    def after_step(self) -> None:
        if self.directory is None:
            return
        self.count += 1
        profile = self._profile
        if profile is None:
            return
        profile.disable()
        if self.describe is not None:
            self._served.update(self.describe())
        self._done += 1
        if self._done < self.steps:
            profile.enable()
            return
        seconds = time.perf_counter() - self._start
        self._profile = None
        try:   # never a reason for the serving loop to fail
            out = io.StringIO()
            served = ", ".join(f"{k} {v}" for k, v in sorted(self._served.items())) or "-"
            out.write(f"{self.steps} steps from step {self.count - self.steps}: {1e3 * seconds / self.steps:.3f} ms "
                      f"per step (wall, profiler included); served (request-steps by mode): {served}\n\n")
            stats = pstats.Stats(profile, stream=out)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(35)
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"cprofile_{os.getpid()}_{self.windows}.txt"
            path.write_text(out.getvalue())
            logger.warning("cProfile of %d steps written to %s", self.steps, path)
        except Exception:
            logger.exception("DDTREE_CPROFILE: could not write the profile to %s", self.directory)
        self.windows += 1


def name_native_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: /proc/<pid>/task/<tid>/comm, at most 15 bytes), so that top,
    py-spy and perf/serve_overhead.py's per-thread CPU table can tell the engine's threads from the stub's. Best
    effort: a no-op where prctl is unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError, TypeError):
        pass
