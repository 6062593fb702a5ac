"""perf/kernel_resources.py's arithmetic: the programs an sm90 (or sm120) SM holds, from a kernel's shared memory,
registers and warps (the compile itself needs Triton's compiler, not its interpreter: the script runs it, not the suite)."""

from __future__ import annotations

import pytest

from perf.kernel_resources import programs_per_sm, table


@pytest.mark.parametrize("shared, registers, warps, programs, limit", [
    (98304, 71, 4, 2, "shared"),        # the swapped few-rows kernel at 17 rows: two 96 KB pipelines an SM
    (122880, 96, 4, 1, "shared"),       # ... with PDL's peeled first tile: one
    (1024, 255, 4, 2, "registers"),     # a GEMV at 255 registers a thread: 64K / (255 -> 256 x 128)
    (0, 32, 1, 32, "cap"),              # small programs: the SM's cap
    (0, 16, 32, 2, "threads"),          # 1024 threads a program
])
def test_programs_per_sm(shared, registers, warps, programs, limit):
    found = programs_per_sm(shared, registers, warps)
    assert found["programs"] == programs == found[limit]


@pytest.mark.parametrize("shared, registers, warps, arch, programs, limit", [
    (98304, 71, 4, 90, 2, "shared"),
    (122880, 140, 4, 120, 0, "shared"),   # Hopper's cut of the lm_head's few-rows pipeline on sm120: does not launch
    (49152, 80, 4, 120, 2, "shared"),     # the same cut to sm120's budget (gemv_kernel.shared_budget)
    (0, 32, 1, 120, 24, "cap"),           # sm120 holds 24 programs an SM, not 32
    (0, 16, 16, 120, 3, "threads"),       # ... and 1536 threads
])
def test_programs_per_sm_by_architecture(shared, registers, warps, arch, programs, limit):
    found = programs_per_sm(shared, registers, warps, arch)
    assert found["programs"] == programs == found[limit]


def test_table_lists_each_form_and_errors():
    rows = [{"kernel": "rows swapped", "shape": "5120x6144", "prologue": "-", "rows": 17, "config": (64, 128, 4, 4),
             "forms": {"loop": {"shared": 98304, "registers": 71, "spill_bytes": 0, "occupancy": {"programs": 2}},
                       "peel": {"error": "CompilationError: x"}}}]
    text = table(rows, ["loop", "peel"])
    assert "| rows swapped | 5120x6144 | - | 17 | (64, 128, 4, 4) | 96 / 71 / 0 / 2 | error: CompilationError: x |" in text
