"""Prometheus metrics of the ddtree model: the acceptance-length histogram and the round counters agree."""

from __future__ import annotations

import time

from client.chat import build_inputs, stream_chat
from tests.server.conftest import scrape, wait_idle

MESSAGES = [{"role": "user", "content": "Name three colours."}]
BUCKETS = [str(length) for length in range(1, 18)] + ["+Inf"]     # the le labels, as Triton prints them


def run(server, sampling) -> list[dict]:
    return [outputs for _, outputs in stream_chat(server.grpc_url, "ensemble", build_inputs(MESSAGES, sampling))]


def delta(after: dict, before: dict, name: str) -> float:
    return after[name] - before.get(name, 0.0)


def bucket_names() -> list[str]:
    return [f'ddtree_acceptance_length_bucket{{le="{le}"}}' for le in BUCKETS]


def buckets(samples: dict) -> list[float]:
    """Cumulative bucket counts, le = 1 .. 17 then +Inf."""
    return [samples[name] for name in bucket_names()]


def test_new_metrics_are_exported(server):
    samples = scrape(server)
    for name in bucket_names() + ["ddtree_acceptance_length_sum", "ddtree_acceptance_length_count",
                                  "ddtree_host_seconds_total", "ddtree_batch_rounds_total", "ddtree_serve_seconds_total",
                                  "ddtree_static_programs_late_total", "ddtree_responses_total",
                                  "ddtree_time_to_first_token_seconds_count", "ddtree_request_latency_seconds_sum",
                                  'ddtree_time_to_first_token_seconds_bucket{le="0.001"}',
                                  "ddtree_request_queue_seconds_count", "ddtree_request_prefill_seconds_sum",
                                  "ddtree_request_take_seconds_count", "ddtree_slow_steps_total",
                                  "ddtree_slow_step_seconds_total", "ddtree_gc_seconds_total",
                                  "ddtree_gc_full_collections_total", "ddtree_dynamic_forwards_total",
                                  "ddtree_response_send_seconds_total", "ddtree_cancel_check_seconds_total",
                                  "ddtree_cancel_checks_total", "ddtree_metrics_publish_seconds_total",
                                  "ddtree_metrics_publishes_total"]:
        assert name in samples, sorted(samples)


def test_acceptance_histogram_matches_rounds_and_tokens(server):
    """ar: every round commits exactly one token and counts in ddtree_rounds_total, not in the histogram (drafting rounds
    only: an observation per request and step was a Triton IPC call each). ddtree: the histogram's sum and count equal
    the requests' own acceptance statistics (mean acceptance length x rounds, rounds)."""
    before, start = wait_idle(server), time.perf_counter()
    max_tokens, requests, received = 10, 3, 0
    for _ in range(requests):
        responses = run(server, {"max_tokens": max_tokens, "ignore_eos": True, "mode": "ar", "temperature": 0})
        received += sum("text_output" in outputs for outputs in responses)   # not an empty final of the ensemble
    after = wait_idle(server, before["ddtree_requests_finished_total"] + requests)
    rounds = requests * (max_tokens - 1)         # the first token of each request comes from its prefill
    assert delta(after, before, "ddtree_output_tokens_total") == requests * max_tokens
    assert delta(after, before, "ddtree_responses_total") == received >= requests
    # the sending thread's time in Triton's sends, and its cancellation asks (at least the one as each request starts)
    assert 0 < delta(after, before, "ddtree_response_send_seconds_total") < time.perf_counter() - start
    assert delta(after, before, "ddtree_cancel_checks_total") >= requests
    assert 0 < delta(after, before, "ddtree_cancel_check_seconds_total") < time.perf_counter() - start
    # the metrics' own publishing (on a thread of their own): updates while the requests ran, and their time
    assert delta(after, before, "ddtree_metrics_publishes_total") >= 1
    assert 0 < delta(after, before, "ddtree_metrics_publish_seconds_total") < time.perf_counter() - start
    # every request's time to its first token and to its last, inside the time the client waited for them all
    assert delta(after, before, "ddtree_time_to_first_token_seconds_count") == requests
    assert delta(after, before, "ddtree_request_latency_seconds_count") == requests
    ttft, latency = (delta(after, before, f"ddtree_{name}_seconds_sum") for name in ("time_to_first_token", "request_latency"))
    assert 0 < ttft < latency < time.perf_counter() - start
    # of each time to first token: the wait for the prefill that admits it, and that prefill
    queue, prefill = (delta(after, before, f"ddtree_request_{name}_seconds_sum") for name in ("queue", "prefill"))
    assert delta(after, before, "ddtree_request_queue_seconds_count") == requests
    assert delta(after, before, "ddtree_request_prefill_seconds_count") == requests
    assert 0 <= queue and 0 < prefill and queue + prefill <= ttft
    # of each queue time: the wait for the engine thread to take the request
    assert delta(after, before, "ddtree_request_take_seconds_count") == requests
    assert 0 <= delta(after, before, "ddtree_request_take_seconds_sum") <= queue
    assert delta(after, before, "ddtree_rounds_total") == rounds
    assert delta(after, before, "ddtree_acceptance_length_count") == 0
    assert delta(after, before, "ddtree_acceptance_length_sum") == 0
    assert buckets(after) == buckets(before)
    assert 0 < delta(after, before, "ddtree_batch_rounds_total") <= rounds

    before, start = after, time.perf_counter()
    committed, num_rounds = 0, 0
    for budget in (4, 16):
        final = run(server, {"max_tokens": 24, "temperature": 0, "mode": "ddtree", "tree_budget": budget})[-1]
        num_rounds += final["num_rounds"][0]
        committed += round(final["mean_acceptance_length"][0] * final["num_rounds"][0])
    after = wait_idle(server, before["ddtree_requests_finished_total"] + 2)
    elapsed = time.perf_counter() - start
    # every round either verified drafted nodes (in the histogram) or its root alone (one token, e.g. a request's
    # last round with room for one token): the histogram and the ones make up the requests' own statistics
    drafted = delta(after, before, "ddtree_acceptance_length_count")
    assert delta(after, before, "ddtree_rounds_total") == num_rounds and 0 < drafted <= num_rounds
    assert delta(after, before, "ddtree_acceptance_length_sum") + (num_rounds - drafted) == committed
    # a round's tokens are cut only at the end (max_tokens, a stop): never more output than accepted
    assert delta(after, before, "ddtree_output_tokens_total") - 2 <= committed
    cumulative = buckets(after)
    assert cumulative == sorted(cumulative) and cumulative[-1] == after["ddtree_acceptance_length_count"]
    assert cumulative[16] == cumulative[-1], "a round commits at most block_size (16) tokens"
    host = delta(after, before, "ddtree_host_seconds_total")
    passes = delta(after, before, "ddtree_draft_seconds_total") + delta(after, before, "ddtree_verify_seconds_total")
    serve = delta(after, before, "ddtree_serve_seconds_total")    # streaming, cancellation checks, metrics
    assert 0 < host and 0 < passes and 0 < serve and host + passes + serve < elapsed


def test_auto_rounds_are_counted_per_arm(server):
    """mode auto: every batch round it runs is counted under the arm it chose (ddtree_auto_arm_rounds_total{arm}),
    one series per configured arm, and its time too (ddtree_auto_arm_seconds_total{arm}: what auto measures the arm
    by); requests of other modes add none."""
    before = wait_idle(server)
    arms = sorted(name for name in before if name.startswith("ddtree_auto_arm_rounds_total{"))
    assert 'ddtree_auto_arm_rounds_total{arm="ar"}' in arms and 'ddtree_auto_arm_rounds_total{arm="policy"}' in arms, arms
    timed = [name.replace("_rounds_", "_seconds_") for name in arms]
    assert all(name in before for name in timed), sorted(before)
    run(server, {"max_tokens": 12, "ignore_eos": True, "mode": "ddtree", "tree_budget": 4, "temperature": 0})
    middle = wait_idle(server, before["ddtree_requests_finished_total"] + 1)
    assert sum(delta(middle, before, name) for name in arms + timed) == 0
    start = time.monotonic()
    for _ in range(3):
        run(server, {"max_tokens": 12, "ignore_eos": True, "mode": "auto", "temperature": 0})
    after = wait_idle(server, middle["ddtree_requests_finished_total"] + 3)
    elapsed = time.monotonic() - start
    counted = {name: delta(after, middle, name) for name in arms}
    assert sum(counted.values()) == delta(after, middle, "ddtree_batch_rounds_total") > 0, counted
    assert all(value >= 0 for value in counted.values())
    seconds = {name: delta(after, middle, name) for name in timed}
    # an arm has time exactly where it has rounds; auto's rounds fit in the requests' time
    assert {name for name, value in seconds.items() if value > 0} == {
        name.replace("_rounds_", "_seconds_") for name, value in counted.items() if value > 0}, (seconds, counted)
    assert 0 < sum(seconds.values()) < elapsed, (seconds, elapsed)
