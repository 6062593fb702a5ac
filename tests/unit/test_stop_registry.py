import os
import time

from ddtree.stop_registry import StopRegistry


def test_marker_reaches_the_owner_once(tmp_path):
    a, b = StopRegistry(tmp_path), StopRegistry(tmp_path)     # two instances, one directory
    assert a.post("req-1") and a.post("req-2")
    assert b.claim({"req-3"}) == []                           # not b's request: left for its owner
    assert sorted(b.claim({"req-1", "req-2"})) == ["req-1", "req-2"]
    assert b.claim({"req-1"}) == [] and a.claim({"req-1", "req-2"}) == []


def test_bad_keys_are_refused_and_stale_markers_expire(tmp_path):
    registry = StopRegistry(tmp_path, ttl_s=60)
    assert not registry.post("../etc/passwd") and not registry.post("") and not registry.post("a" * 200)
    registry.post("old")
    past = time.time() - 120
    os.utime(tmp_path / "old", (past, past))
    registry.post("fresh")
    assert registry.claim(set()) == []
    assert sorted(os.listdir(tmp_path)) == ["fresh"]
