"""What a benchmark result says about the code that ran (perf.common.commit): a copy whose .git is behind its files
names the commit of those files through their tree id."""

from __future__ import annotations

import gc
import subprocess

import pytest

from perf import common


def git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.rstrip("\n")


def test_a_dirty_copy_names_the_tree_of_the_files_that_ran(tmp_path, monkeypatch):
    monkeypatch.delenv("DDTREE_COMMIT", raising=False)
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("out/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base")
    base = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert common.commit(tmp_path) == base
    # the files move on (a later commit's, as the device copy gets them), plus an ignored output
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 3\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "result.json").write_text("{}\n")
    reported = common.commit(tmp_path)
    assert reported.startswith(f"{base}-dirty (worktree ")
    index_before = git(tmp_path, "status", "--porcelain")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "later")
    # the later commit's tree is the one the run reported, and the throwaway index left the repository's alone
    assert reported == f"{base}-dirty (worktree {git(tmp_path, 'rev-parse', 'HEAD^{tree}')[:12]})"
    assert index_before.splitlines() == [" M a.py", "?? b.py"]   # nothing staged in the repository's own index
    assert common.commit(tmp_path) == git(tmp_path, "rev-parse", "--short", "HEAD")


def test_the_environment_names_the_commit_where_it_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("DDTREE_COMMIT", "abc1234")
    assert common.commit(tmp_path) == "abc1234"


def test_results_record_the_engine_settings_they_ran_under(tmp_path, monkeypatch):
    from perf import common

    monkeypatch.setenv("DDTREE_GEMV_SWAP", "1")
    monkeypatch.setenv("DDTREE_COMMIT", "abc1234")
    meta = common.header()
    assert meta["environment"].get("DDTREE_GEMV_SWAP") == "1" and "DDTREE_COMMIT" not in meta["environment"]
    common.write_results(tmp_path, "r", {"header": meta}, "table")
    assert '"DDTREE_GEMV_SWAP": "1"' in (tmp_path / "r.md").read_text()


def test_an_in_process_probe_freezes_the_heap_as_the_served_model_does_and_unfreezes_it_after():
    gc.unfreeze()
    with common.frozen_heap(False):
        assert gc.get_freeze_count() == 0
    with common.frozen_heap(True):
        assert gc.get_freeze_count() > 1000   # what this process holds (torch, the test modules)
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), common.frozen_heap(True):
        raise RuntimeError("a probe that fails leaves the caller's collector as it found it")
    assert gc.get_freeze_count() == 0


def test_a_cost_model_records_the_settings_it_was_measured_under(tmp_path, monkeypatch):
    """fit_cost_model's data names the DDTREE_* settings of its run in its source (cost_model_h100_sdpatrees.json
    was measured with DDTREE_ATTENTION_KERNEL=1 and did not say so)."""
    import json
    import os

    from ddtree.budget import CostModel

    for key in [k for k in os.environ if k.startswith("DDTREE_") and k != "DDTREE_COMMIT"]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("DDTREE_COMMIT", "abc1234")
    common.write_cost_model(tmp_path / "a.json", [1, 2], [1.0, 2.0], 0.5)
    assert "abc1234 on " in json.loads((tmp_path / "a.json").read_text())["source"]
    monkeypatch.setenv("DDTREE_ATTENTION_KERNEL", "1")
    common.write_cost_model(tmp_path / "b.json", [1, 2], [1.0, 2.0], 0.5)
    source = json.loads((tmp_path / "b.json").read_text())["source"]
    assert 'abc1234 with {"DDTREE_ATTENTION_KERNEL": "1"} on ' in source
    assert CostModel.load(tmp_path / "b.json").source == source
