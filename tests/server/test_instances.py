"""Two instances of the generation model in one server (the data-parallel layout of one replica per
GPU, here as two CPU instances): a cancelled ensemble stream is stopped whichever instance the
relayed stop request reaches, and each instance reports its own metrics."""

from __future__ import annotations

import queue
import re
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from client.chat import build_inputs
from tests.server.conftest import wait_for_cancellation

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from triton_env import TritonServer  # noqa: E402

TRIALS = 6   # a stop lost on the wrong instance would survive each trial with probability ~1/2


def metrics(server) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()


def total(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def two_instances(model_repository, tmp_path_factory):
    repo = tmp_path_factory.mktemp("instances") / "model_repository"
    shutil.copytree(model_repository, repo)
    config = repo / "ddtree" / "config.pbtxt"
    text, count = re.subn(r"^instance_group \[.*\]$", "instance_group [ { count: 2, kind: KIND_CPU } ]",
                          config.read_text(), flags=re.M)
    assert count == 1
    config.write_text(text)
    log = tmp_path_factory.mktemp("instances-log") / "tritonserver.log"
    with TritonServer(str(repo), log_path=str(log)) as server:
        yield server


def test_each_instance_reports_its_own_metrics(two_instances):
    instances = set(re.findall(r'ddtree_active_requests\{[^}]*instance="([^"]+)"', metrics(two_instances)))
    assert len(instances) == 2, instances


def test_cancelled_streams_stop_on_whichever_instance_runs_them(two_instances):
    sampling = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True, "mode": "ar"}
    for trial in range(TRIALS):
        before = total(metrics(two_instances), "ddtree_requests_cancelled_total")
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(two_instances.grpc_url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", build_inputs([{"role": "user", "content": f"Count to 500, trial {trial}."}],
                                                           sampling))
        for _ in range(2):   # the stream is flowing
            result, error = responses.get(timeout=120)
            assert error is None, error
        client.stop_stream(cancel_requests=True)
        client.close()
        wait_for_cancellation(two_instances, before, timeout_s=20)   # 1000 tokens would take minutes: only a relayed stop ends it this soon
        text = metrics(two_instances)
        assert total(text, "ddtree_active_requests") == 0, f"trial {trial}: the cancelled request still runs"
        assert total(text, "ddtree_held_cache_slots") == 0
    log = Path(two_instances.log_path).read_text()
    print(f"stops relayed between instances: {log.count('stop relayed from another instance')} of {TRIALS}")


def test_a_stopped_server_leaves_no_stop_directory(two_instances):
    """Runs last in this module (it stops the server, after the cancelled streams above): no cancelled ensemble
    request is left in flight, so the server stops gracefully (its models finalized); both instances shared one
    stop directory while they served, and the last to finalize removed it: restarts leave nothing in /dev/shm."""
    from ddtree.stop_registry import default_directory

    directory = default_directory("ddtree").parent / f"ddtree-stops-{two_instances.process.pid}-ddtree"
    assert directory.is_dir()
    two_instances.stop()
    log = Path(two_instances.log_path).read_text()
    assert "Exit timeout expired" not in log, log[-2000:]
    assert not re.search(r"'ensemble' \(version 1\) has \d+ in-flight", log), "cancelled ensemble requests left in flight"
    assert not directory.exists()
