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


def test_service_looks_for_relayed_stops_at_most_every_check_interval(tiny_models, tmp_path, monkeypatch):
    """Listing the registry is a system call: the serving loop does it once per CANCEL_CHECK_S, not every round."""
    from ddtree import serving
    from ddtree.config import EngineConfig
    from ddtree.engine import Engine
    from ddtree.tokenizer import Tokenizer
    from tests.unit.test_stop_strings import serve

    registry = StopRegistry(tmp_path)
    calls = []
    claim = registry.claim
    monkeypatch.setattr(registry, "claim", lambda keys: calls.append(len(keys)) or claim(keys))
    monkeypatch.setattr(serving, "CANCEL_CHECK_S", 3600.0)
    engine = Engine(EngineConfig(target_path=str(tiny_models / "qwen3-target"), drafter_path=str(tiny_models / "qwen3-dflash"),
                                 max_model_len=128, max_num_seqs=2))
    service = serving.GenerationService(engine, Tokenizer(tiny_models / "qwen3-target"), stop_registry=registry)
    try:
        sink = serve(service, service.tokenizer, {"max_tokens": 24, "ignore_eos": True, "mode": "ar"}, stream=True)
    finally:
        service.shutdown()
    assert sum(o.get("num_output_tokens", 0) for o in sink.outputs) == 24   # 23 rounds after the prefill
    assert calls == [1]


def test_close_removes_the_directory_once_empty(tmp_path):
    """Each server leaves nothing behind: closing drops markers nobody claimed in time, the last instance to close
    removes the shared directory; a fresh marker for another instance stays, and a post after a close recreates
    the directory."""
    directory = tmp_path / "stops"
    a, b = StopRegistry(directory), StopRegistry(directory)
    a.post("ended")       # for a request that had ended when its stop arrived: nobody claims it
    past = time.time() - 10
    os.utime(directory / "ended", (past, past))
    a.post("pending")
    a.close()
    assert directory.is_dir() and os.listdir(directory) == ["pending"]
    assert b.claim({"pending"}) == ["pending"]
    b.close()
    assert not directory.exists()
    assert a.post("late") and os.listdir(directory) == ["late"]
