"""perf/drain_probe.py, a few rounds: each mode's responses go out, from the engine thread where it drains."""

from __future__ import annotations

from perf import drain_probe


def test_the_probe_sends_each_modes_responses_and_drains_only_in_drain(tmp_path):
    result = drain_probe.main(["--rounds", "30", "--turns", "1", "--draft-wait-us", "2000", "--verify-wait-us", "500",
                               "--out", str(tmp_path), "--name", "dp"])
    (turn,) = result["turns"]
    assert turn["none"]["sent"] == 0
    assert turn["thread"]["sent"] == turn["drain"]["sent"] == 30
    assert turn["thread"]["sent_by_engine"] == 0
    assert turn["drain"]["sent_by_engine"] > 15   # a 2 ms wait holds a 60 us call: most go from the engine thread
    assert "| drain |" in (tmp_path / "dp.md").read_text()
