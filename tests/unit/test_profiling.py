"""DDTREE_PROFILE's step profiler: off unless set, then one table file for the chosen window of steps."""

import torch

from ddtree.profiling import StepProfiler


def run_steps(profiler: StepProfiler, n: int) -> None:
    for _ in range(n):
        profiler.before_step()
        torch.ones(8, 8) @ torch.ones(8, 8)
        profiler.after_step()


def test_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("DDTREE_PROFILE", raising=False)
    profiler = StepProfiler()
    run_steps(profiler, 5)
    assert profiler.directory is None and profiler.count == 0


def test_profiles_the_window_of_steps_it_names(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_PROFILE", f"{tmp_path}:2:3")
    profiler = StepProfiler()
    run_steps(profiler, 4)
    assert list(tmp_path.iterdir()) == []          # the window (steps 3..5) is not over yet
    run_steps(profiler, 3)
    (path,) = tmp_path.iterdir()
    text = path.read_text()
    assert text.startswith("3 steps after 2:")
    (mm,) = [line for line in text.splitlines() if line.strip().startswith("aten::mm ")]
    assert mm.split()[-1] == "3"                   # the matmuls of those 3 steps, not of the others


def test_a_bad_setting_or_an_unwritable_directory_never_stops_serving(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_PROFILE", f"{tmp_path}:two:3")
    profiler = StepProfiler()
    run_steps(profiler, 5)
    assert profiler.directory is None                  # logged, not profiling
    blocker = tmp_path / "file"
    blocker.write_text("")
    profiler = StepProfiler(f"{blocker}/sub:0:2")      # a directory under a file: cannot be made
    run_steps(profiler, 3)                             # the write fails inside after_step: logged, no exception
    assert profiler.count == 3 and not (blocker / "sub").exists()


def test_named_native_thread():
    """The engine's threads carry OS-level names (what per-thread CPU tables and top show)."""
    import os
    import threading

    from ddtree.profiling import name_native_thread

    seen = {}

    def run():
        name_native_thread("ddtree-engine-long-name")
        tid = threading.get_native_id()
        with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
            seen["comm"] = f.read().strip()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["comm"] == "ddtree-engine-l"   # truncated to the kernel's 15 bytes


def test_cprofile_windows_repeat_and_name_what_they_served(tmp_path, monkeypatch):
    """DDTREE_CPROFILE: a window of steps after `skip`, again every `every` steps, each its own file with the modes
    its steps served (one server serving `ar`, then `auto`, profiles both)."""
    from ddtree.profiling import CProfileWindows

    modes = ["ar", "ar"]
    windows = CProfileWindows(f"{tmp_path}:1:2:4", describe=lambda: modes)

    def matmul_step():
        torch.ones(8, 8) @ torch.ones(8, 8)

    def steps(n):
        for _ in range(n):
            windows.before_step()
            matmul_step()
            windows.after_step()

    steps(3)                                        # step 0 skipped, steps 1-2 the first window
    (first,) = tmp_path.iterdir()
    modes = ["auto"]
    steps(4)                                        # steps 3-4 outside, 5-6 the second window
    second = tmp_path / first.name.replace("_0.txt", "_1.txt")
    assert sorted(tmp_path.iterdir()) == sorted([first, second])
    head = first.read_text().splitlines()[0]
    assert head.startswith("2 steps from step 1:") and head.endswith("served (request-steps by mode): ar 4")
    assert second.read_text().splitlines()[0].endswith("served (request-steps by mode): auto 2")
    assert "matmul_step" in second.read_text()      # the functions the steps ran, by cProfile
    assert windows.count == 7 and windows.windows == 2


def test_cprofile_off_by_default_and_a_typo_never_stops_serving(tmp_path, monkeypatch):
    from ddtree.profiling import CProfileWindows

    monkeypatch.delenv("DDTREE_CPROFILE", raising=False)
    assert CProfileWindows().directory is None
    windows = CProfileWindows(f"{tmp_path}:x")
    windows.before_step()
    windows.after_step()
    assert windows.directory is None and list(tmp_path.iterdir()) == []
