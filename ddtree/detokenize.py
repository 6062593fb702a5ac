"""Exact streaming detokenization with a stateless decode step.

The generation model owns the offsets (IncrementalDetokenizer); every streamed response carries
a window of ids plus how many of them are already-emitted context, and `decode_delta` - a pure
function that the postprocessing model runs - turns that window into exactly the new text.
Concatenating the deltas gives `decode(all output ids)`: a window always starts where earlier
text ended on a whole character, and text ending in an incomplete UTF-8 sequence is held
back until the character completes (or the request ends).
"""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"


def decode(tokenizer, ids: list[int]) -> str:
    """The one-shot decode every text in the stream is compared against."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def decode_delta(tokenizer, window: list[int], prefix_length: int) -> str:
    """Text the last len(window) - prefix_length ids add after the first prefix_length ids."""
    if len(window) == prefix_length:
        return ""
    prefix = decode(tokenizer, window[:prefix_length]) if prefix_length else ""
    return decode(tokenizer, window)[len(prefix):]


@dataclass(slots=True)
class StreamChunk:
    window: list[int]       # ids to decode: prefix_length context ids, then the new ones
    prefix_length: int
    text: str               # what decode_delta(window, prefix_length) returns


class IncrementalDetokenizer:
    """Per-request offsets into the output ids (vLLM's prefix/read offset scheme)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0   # start of the context window
        self.read_offset = 0     # ids before this are already emitted as text

    def push(self, new_ids: list[int], is_final: bool) -> StreamChunk:
        """Add ids; return the chunk to send now (empty text when held back)."""
        self.ids.extend(new_ids)
        window = self.ids[self.prefix_offset :]
        prefix_length = self.read_offset - self.prefix_offset
        text = decode_delta(self.tokenizer, window, prefix_length)
        if not is_final and (not text or text.endswith(REPLACEMENT)):
            return StreamChunk(window=window[:prefix_length], prefix_length=prefix_length, text="")
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return StreamChunk(window=window, prefix_length=prefix_length, text=text)
