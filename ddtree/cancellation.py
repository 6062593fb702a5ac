"""How often a sending thread asks Triton whether a client cancelled: the GenerationService's outbox in process, and
with engine_process the stub's relay thread (this module imports nothing: the stub side does not import torch)."""

# Asking a sender whether its client cancelled is an IPC round trip in Triton (~0.2 ms), so the engine thread never
# asks: the outbox asks after each response it sends, and the engine thread queues a check for a request nobody
# asked about for this long (no text this round, or a non-streamed request).
CANCEL_CHECK_S = 0.02
# ... and at most this many asks a second in all: with many requests each is asked less often (every live / this
# seconds: 32 streams, every 0.16 s). Through the ensemble the asks never find a cancellation (Triton 2.51 does not
# pass an ensemble client's cancellation to the generation model's request; the postprocessing step relays it as a
# stop); every 20 ms each they would be 1,600 IPC round trips a second at 32 streams, beside the responses' sends (on
# the 2-core CPU at 16 streams, 605-627 asks a second at 0.07-0.13 ms each: concurrency_sweep.py's sender table).
CANCEL_ASKS_PER_S = 200.0


def cancel_check_interval(live: int) -> float:
    """How long a request goes unasked at most while `live` requests are asked (CANCEL_CHECK_S, CANCEL_ASKS_PER_S)."""
    return max(CANCEL_CHECK_S, live / CANCEL_ASKS_PER_S)
