"""TritonMetrics (ddtree/triton_common.py) against a stand-in of the Python backend's custom-metrics API that refuses
what Triton refuses: a counter incremented by a negative value."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from ddtree.serving import ServiceStats
from ddtree.triton_common import TritonMetrics


class _Metric:
    def __init__(self, kind: str) -> None:
        self.kind, self.value, self.samples = kind, 0.0, []

    def increment(self, value: float) -> None:
        if self.kind == "counter" and value < 0:
            raise ValueError("counter metrics cannot be decremented")   # as TRITONSERVER_MetricIncrement
        self.value += value

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.samples.append(value)


class _Family:
    HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"
    made: dict[str, _Metric] = {}

    def __init__(self, name: str, text: str, kind: str) -> None:
        self.name, self.kind = name, kind

    def Metric(self, labels: dict, **kw) -> _Metric:  # noqa: N802 (pb_utils' name)
        metric = _Metric(self.kind)
        self.made[self.name + str(sorted(labels.items()))] = metric
        return metric


def test_a_counter_that_went_down_is_skipped_and_the_fields_after_it_still_publish():
    _Family.made = {}
    metrics = TritonMetrics(SimpleNamespace(MetricFamily=_Family), threading.Lock(), {"model": "m"})
    by_name = {key.split("[")[0]: metric for key, metric in _Family.made.items()}
    host, serve, active = by_name["ddtree_host_seconds_total"], by_name["ddtree_serve_seconds_total"], \
        by_name["ddtree_active_requests"]
    stats = ServiceStats()
    for host_s, serve_s, num_active in ((1.0, 0.5, 3), (0.8, 0.7, 2), (1.5, 0.9, 1)):
        stats.host_seconds, stats.serve_seconds, stats.num_active = host_s, serve_s, num_active
        metrics.update(stats)   # no exception: the lower host time is skipped
        assert serve.value == serve_s and active.value == num_active
    assert host.value == 1.5   # counted on from its highest value
