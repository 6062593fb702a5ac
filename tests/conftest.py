"""Shared fixtures: tiny checkpoints made once per session by scripts/make_tiny_models.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.triton_interpreter import interpret_on_the_cpu  # noqa: E402

interpret_on_the_cpu()   # before anything imports triton: its own jit functions are defined at its import


def pytest_configure(config) -> None:
    """Under pytest-xdist (make test runs two workers on the CI's two cores) each worker's torch computes on one
    thread, and so do the processes it starts (OMP_NUM_THREADS: a tritonserver's model processes): two of two
    threads each on two cores contend for them, and a parallel region waits for its descheduled thread (a tiny
    hybrid's static warm-up took over 120 s instead of 24)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)


def pytest_xdist_make_scheduler(config, log):
    """make test's --dist loadfile, with every end-to-end test in one unit: they run in order on one worker (they
    share one tritonserver per session, tests/server/conftest.py, and time some responses), while the other files
    go one at a time to whichever worker is free (a file's module fixtures, e.g. a loaded engine, made once).
    xdist's own loadgroup would do it by marks, but with pytest 9 it loses them (it renames nodes by `_nodeid`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ServerTestsAsOneFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/server" if path.startswith("tests/server/") else path

    return ServerTestsAsOneFile(config, log)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), "--out", str(out)],
                   check=True, capture_output=True)
    return out
