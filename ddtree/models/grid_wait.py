"""The one place our Triton kernels wait for the grid before them under Programmatic Dependent Launch (kernels.pdl,
whose docstring has the rules): every kernel calls wait_for_previous_grid(PDL) before any load of what another kernel
writes and before any store, after nothing but loads of read-only weights."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """With PDL: until the grid before has completed and its writes are visible, then let the next PDL launch start
    (never the other way round: a grid launched early runs past its own wait only once every grid before it has
    completed). Without: nothing (the kernel compiles as it would without the call)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
