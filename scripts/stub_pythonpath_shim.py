# --- Prepended by scripts/setup_tritonserver.sh ----------------------------------------------------------
# Triton 2.51's triton_python_backend_stub (pybind11 2.10) starts Python >= 3.11 with an isolated config
# that ignores PYTHONPATH. This module is imported by the stub before model.py and before numpy, so honour
# PYTHONPATH here: its entries go first on sys.path, and their .pth files are read (like site-packages).
def _honour_pythonpath():
    import os
    import site
    import sys

    wanted = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if not wanted:
        return
    before = list(sys.path)
    for p in wanted:
        site.addsitedir(p)
    sys.path[:] = [p for p in sys.path if p not in before] + before


_honour_pythonpath()
del _honour_pythonpath
# --- End of the prepended part ----------------------------------------------------------------------------
