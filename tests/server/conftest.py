"""One real tritonserver per test session, serving a copy of model_repository/ with the embedded default."""

from __future__ import annotations

import re
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from triton_env import TritonServer  # noqa: E402

DEFAULT_TARGET = ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_DRAFTER = ROOT / "models" / "smollm2-135m-instruct-dflash"
MAX_MODEL_LEN = 1024
MAX_TOKENS_LIMIT = 1000
MAX_NUM_SEQS = 4
MAX_QUEUE_SIZE = 6


def set_parameter(config: Path, key: str, value: str) -> None:
    text = config.read_text()
    pattern = rf'(key: "{key}", value: {{ string_value: )"[^"]*"'
    assert re.search(pattern, text), f"{key} not in {config}"
    config.write_text(re.sub(pattern, rf'\1"{value}"', text))


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    if not (DEFAULT_TARGET / "config.json").exists():
        pytest.fail("the embedded default is missing: run `make setup`")
    repo = tmp_path_factory.mktemp("server") / "model_repository"
    shutil.copytree(ROOT / "model_repository", repo)
    for model in ("preprocessing", "postprocessing"):
        set_parameter(repo / model / "config.pbtxt", "tokenizer_path", str(DEFAULT_TARGET))
    config = repo / "ddtree" / "config.pbtxt"
    set_parameter(config, "target_path", str(DEFAULT_TARGET))
    set_parameter(config, "drafter_path", str(DEFAULT_DRAFTER))
    set_parameter(config, "max_model_len", str(MAX_MODEL_LEN))
    set_parameter(config, "max_tokens_limit", str(MAX_TOKENS_LIMIT))
    set_parameter(config, "max_tree_budget", "64")
    set_parameter(config, "max_num_seqs", str(MAX_NUM_SEQS))
    set_parameter(config, "max_queue_size", str(MAX_QUEUE_SIZE))
    return repo


@pytest.fixture(scope="session")
def server(model_repository, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-log") / "tritonserver.log"
    with TritonServer(str(model_repository), log_path=str(log)) as running:
        yield running


def metric(server, name: str) -> float:
    """A counter or gauge from Triton's /metrics, summed over its label sets (models, instances)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def wait_for_cancellation(server, cancelled_before: float, timeout_s: float = 60.0) -> None:
    """Wait until the server counts one more cancelled request and none is active (or the time is up: the
    caller's asserts then say which part failed)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and (metric(server, "ddtree_active_requests") > 0
                                      or metric(server, "ddtree_requests_cancelled_total") <= cancelled_before):
        time.sleep(0.2)


def scrape(server) -> dict[str, float]:
    """ddtree_* samples by name and labels other than model/instance, e.g. 'ddtree_acceptance_length_bucket{le="1"}'."""
    samples = {}
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if not line.startswith("ddtree_"):
            continue
        name, value = line.rsplit(" ", 1)
        labels = ",".join(label for label in name[name.find("{") + 1 : -1].split(",") if not label.startswith(("model=", "instance=")))
        samples[name.split("{")[0] + (f"{{{labels}}}" if labels else "")] = float(value)
    return samples


def wait_idle(server, finished: float = 0) -> dict[str, float]:
    """Metrics once the engine holds nothing and at least `finished` requests have finished (updates trail responses),
    and two scrapes 0.2 s apart agree: a publication updates its metrics one by one, so a scrape in the middle of one
    can see the finished count and the gauges of a snapshot whose other counters are still on their way (CI failed
    once at dd3bd1b: 30 auto arm rounds against 32 batch rounds)."""
    deadline = time.time() + 60
    while True:
        samples = scrape(server)
        idle = not samples["ddtree_active_requests"] and not samples["ddtree_waiting_requests"]
        if (idle and samples["ddtree_requests_finished_total"] >= finished) or time.time() > deadline:
            time.sleep(0.2)
            again = scrape(server)
            if again == samples or time.time() > deadline:
                return again
        time.sleep(0.1)
