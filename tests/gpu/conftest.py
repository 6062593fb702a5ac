"""The GPU tests' own hook: a failure's detail is written when it happens, not only in the closing summary, so a run
that the device's time limit cuts off (perf/run_gpu_kernels.sh tests) keeps what failed and why."""

from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    terminal = item.config.pluginmanager.get_plugin("terminalreporter")
    if report.failed and terminal is not None:
        terminal.write_line("")
        terminal.write_line(f"FAILED {report.nodeid} ({report.when}):")
        terminal.write_line(report.longreprtext)
