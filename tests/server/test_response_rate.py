"""stream_response_rate through a real tritonserver of its own (2 responses a second over all streams): streamed text
through the ensemble equals what the session's server (every round sent here) streams, in a few responses; two
streams share the rate; a stream cancelled while its text is held is freed and the server keeps serving."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from client.chat import build_inputs, stream_chat
from tests.server.conftest import TritonServer, metric, set_parameter
from tests.server.test_health import make_repository

RATE = 2   # responses a second over all streams: a stream's responses at least (streams / RATE) s apart
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
SAMPLING = {"max_tokens": 48, "ignore_eos": True, "mode": "ar", "temperature": 0}


@pytest.fixture(scope="module")
def rate_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rate")
    repo = make_repository(tmp)
    set_parameter(repo / "ddtree" / "config.pbtxt", "stream_response_rate", str(RATE))
    with TritonServer(str(repo), log_path=str(tmp / "server.log")) as running:
        yield running


def streamed(server, sampling=SAMPLING) -> tuple[list[str], float]:
    """The text deltas of one streamed chat request through the ensemble, and its seconds."""
    start = time.monotonic()
    texts = [text for text, outputs in stream_chat(server.grpc_url, "ensemble", build_inputs(CHAT, sampling))
             if "text_output" in outputs]
    return texts, time.monotonic() - start


def test_held_rounds_arrive_as_the_same_text_in_fewer_responses(rate_server, server):
    every, _ = streamed(server)
    held, seconds = streamed(rate_server)
    assert "".join(held) == "".join(every) != ""
    # the first text at once, then one response at most every 1 / RATE s, and the end
    assert len(held) <= 2 + int(seconds * RATE) < len(every), (len(held), seconds, len(every))


def test_two_streams_share_the_rate(rate_server, server):
    expected = "".join(streamed(server)[0])
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: streamed(rate_server), range(2)))
    for texts, _ in results:
        assert "".join(texts) == expected
    # RATE responses a second over both streams, besides their first texts and ends (+1 each: a stream's gap follows
    # the number of running streams, which changes as they start and end)
    total, seconds = sum(len(texts) for texts, _ in results), max(seconds for _, seconds in results)
    assert total <= 4 + int(seconds * RATE) + 2, (total, seconds)


def test_a_stream_cancelled_while_its_text_is_held_is_freed(rate_server):
    long = {**SAMPLING, "max_tokens": 400}
    stream = stream_chat(rate_server.grpc_url, "ensemble", build_inputs(CHAT, long))
    next(stream)            # the first text; the rest is held for 1 / RATE s at a time
    stream.close()          # cancels the request (client.chat: an abandoned generator cancels)
    # the metrics are published every METRICS_INTERVAL_S: until the cancellation is counted they may still be the
    # ones from before this request started (no request active), so wait for the count, then for the slot
    def freed() -> bool:
        return (metric(rate_server, "ddtree_requests_cancelled_total") >= 1
                and metric(rate_server, "ddtree_active_requests") == 0
                and metric(rate_server, "ddtree_held_cache_slots") == 0)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not freed():
        time.sleep(0.2)
    assert freed(), {name: metric(rate_server, name) for name in ("ddtree_requests_cancelled_total", "ddtree_active_requests",
                                                                  "ddtree_held_cache_slots", "ddtree_requests_failed_total",
                                                                  "ddtree_requests_finished_total")}
    assert "".join(streamed(rate_server, {**SAMPLING, "max_tokens": 8})[0]) != ""   # still serving
