"""What every benchmark result records: machine, commit, command."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "num_cpus": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def commit(root: Path = ROOT) -> str:
    """The short commit of the code that ran: DDTREE_COMMIT, or HEAD, with "-dirty (worktree T)" where the tracked
    files differ from it. T is the git tree id of the working tree's files (tracked and not ignored): the device copy's
    .git shows the session's base commit, not HEAD, so a run there without DDTREE_COMMIT says "<base>-dirty", and
    `git log --format='%h %T' | grep T` finds the commit whose files ran (worktree_tree)."""
    if os.environ.get("DDTREE_COMMIT"):
        return os.environ["DDTREE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        if not dirty:
            return sha
        tree = worktree_tree(root)
        return f"{sha}-dirty" + (f" (worktree {tree[:12]})" if tree else "")
    except (OSError, subprocess.CalledProcessError):
        # the GPU machine gets a copy of the working tree without .git: perf/run_gpu.sh passes it
        return os.environ.get("DDTREE_COMMIT", "unknown")


def worktree_tree(root: Path = ROOT) -> str | None:
    """The git tree id of the files under root that git does not ignore, as a commit of them would record it (through
    a throwaway index: the repository's own index and HEAD are left alone); None where git cannot say."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            subprocess.run(["git", "add", "-A", "."], cwd=root, env=env, capture_output=True, check=True)
            return subprocess.run(["git", "write-tree"], cwd=root, env=env, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None


def header() -> dict:
    """The run's command, commit, machine, date and the engine settings it ran under (the DDTREE_* environment)."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DDTREE_") and k != "DDTREE_COMMIT"}
    return {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), "commit": commit(),
            "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": env}


def write_results(out_dir: Path, name: str, result: dict, table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    meta = result["header"]
    md = (f"# {name}\n\n- command: `{meta['command']}`\n- commit: `{meta['commit']}`\n"
          f"- machine: `{json.dumps(meta['machine'])}`\n- date: {meta['date']}\n"
          + (f"- environment: `{json.dumps(meta['environment'])}`\n" if meta.get("environment") else "")
          + f"\n{table}\n")
    (out_dir / f"{name}.md").write_text(md)
    print(md)


def write_cost_model(path: Path, rows: list[int], verify_ms: list[float], draft_ms: float, **fields) -> None:
    """ddtree.budget.CostModel data (verify time against rows, one drafter pass), with the run's provenance."""
    meta = header()
    env = f" with {json.dumps(meta['environment'])}" if meta.get("environment") else ""   # the DDTREE_* settings
    data = {"rows": list(rows), "verify_ms": list(verify_ms), "draft_ms": draft_ms,
            "source": f"{meta['command']} @ {meta['commit']}{env} on {json.dumps(meta['machine'])}, {meta['date']}",
            **fields}
    path.write_text(json.dumps(data, indent=2) + "\n")


def add_model_args(parser) -> None:
    """--target/--drafter/--device/--dtype, defaulting to the embedded default on the CPU."""
    parser.add_argument("--target", default=str(ROOT / "models/smollm2-135m-instruct"))
    parser.add_argument("--drafter", default=str(ROOT / "models/smollm2-135m-instruct-dflash"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")


def add_freeze_heap_arg(parser) -> None:
    """--freeze-heap / --no-freeze-heap (default on): what loading and warm-up left frozen, as the served model does."""
    parser.add_argument("--freeze-heap", action=argparse.BooleanOptionalAction, default=True,
                        help="gc.freeze after warm-up, as the served model does (ddtree.serving.freeze_heap; "
                             "--no-freeze-heap: a full collection walks what loading and warm-up left)")


@contextlib.contextmanager
def frozen_heap(on: bool):
    """Within: the heap as the served model keeps it after its warm-up (ddtree.serving.freeze_heap), so an in-process
    probe's steps pay the garbage collection a served one does, not ~100 ms full collections of what loading left;
    unfrozen after (a caller's process, the tests', goes on collecting as before)."""
    if not on:
        yield
        return
    from ddtree.serving import freeze_heap

    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def engine_stages(engine) -> dict:
    """The in-process reading of the counters per_round_ms takes (Engine.stage_times)."""
    t = engine.stage_times
    return {"batch_rounds": t.batch_rounds, "rounds": t.rounds, "draft": t.draft, "verify": t.verify, "host": t.host,
            "verify_gpu": t.verify_gpu, "draft_gpu": t.draft_gpu}


def per_round_ms(before: dict, after: dict) -> dict:
    """Engine stage times per batch round (ms) between two readings of {batch_rounds, rounds, draft, verify, host}:
    the same counters in process (Engine.stage_times) and through Triton (its metrics), so the two sides compare
    stage by stage; mean_batch = request rounds per batch round."""
    rounds = after["batch_rounds"] - before["batch_rounds"]
    stages = ("draft", "draft_gpu", "verify", "verify_gpu", "host", "serve")
    return {f"{k}_ms": 1e3 * (after[k] - before[k]) / max(rounds, 1) for k in stages if k in after} | {
        "batch_rounds": rounds, "mean_batch": (after["rounds"] - before["rounds"]) / max(rounds, 1)}
