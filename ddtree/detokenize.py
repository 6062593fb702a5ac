"""Exact streaming detokenization with a stateless decode step, and stop strings.

The generation model owns the offsets (IncrementalDetokenizer); every streamed response carries
a window of ids, how many of them are already-emitted context, and the character range of the
window's new text to emit; `decode_range` - a pure function that the postprocessing model runs -
turns that into exactly the new text. Concatenating the pieces gives `decode(all output ids)`,
up to the first stop string: a window always starts where earlier text ended on a whole
character, text ending in an incomplete UTF-8 sequence is held back until the character
completes (or the request ends), and so is a tail that may turn out to begin a stop string.
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


def decode_range(tokenizer, window: list[int], prefix_length: int, text_start: int, text_end: int) -> str:
    """Characters [text_start, text_end) of the window's new text: what one response carries."""
    if text_end <= text_start:
        return ""
    return decode_delta(tokenizer, window, prefix_length)[text_start:text_end]


def find_stop(text: str, stop: list[str]) -> int | None:
    """Where the first occurrence of any stop string begins in text, if any."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def stop_prefix_length(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of text that begins some stop string (and may complete it later)."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


@dataclass(slots=True)
class StreamChunk:
    window: list[int]       # ids to decode: prefix_length context ids, then the new ones
    prefix_length: int
    text: str               # what decode_range(window, prefix_length, text_start, text_end) returns
    text_start: int
    text_end: int
    stopped: bool = False   # text ends right before a stop string: the request is done


class IncrementalDetokenizer:
    """Per-request offsets into the output ids (vLLM's prefix/read offset scheme), and stop strings.

    The text after read_offset is decode_delta(ids[prefix_offset:], read_offset - prefix_offset);
    its first `sent` characters are already emitted. What would end inside a character, or may be
    the beginning of a stop string, is held back; the window moves on to the last whole-text point
    at or before what is sent.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.min_tokens = min_tokens     # stop strings count only after this many tokens (vLLM's rule)
        self.ids: list[int] = []
        self.prefix_offset = 0   # start of the context window
        self.read_offset = 0     # the text after this id is decoded again with every push
        self.sent = 0            # characters of that text already emitted
        self.whole_points: list[tuple[int, int]] = []   # (ids, characters after read_offset) where the text was whole
        self.text = ""           # everything emitted

    def push(self, new_ids: list[int], is_final: bool) -> StreamChunk:
        """Add ids; return the chunk to send now (empty text when everything new is held back)."""
        self.ids.extend(new_ids)
        window = self.ids[self.prefix_offset :]
        prefix_length = self.read_offset - self.prefix_offset
        text = decode_delta(self.tokenizer, window, prefix_length)
        whole = len(text) if is_final else len(text.rstrip(REPLACEMENT))
        if text and whole == len(text):
            self.whole_points.append((len(self.ids), whole))
        length, stopped = self._sendable(text[self.sent : whole], is_final)
        start, self.sent = self.sent, self.sent + length
        chunk = StreamChunk(window, prefix_length, text[start : self.sent], start, self.sent, stopped)
        self.text += chunk.text
        self._advance()
        return chunk

    def whole_chunk(self) -> StreamChunk:
        """Everything emitted so far as one chunk of all ids (a non-streamed response)."""
        return StreamChunk(list(self.ids), 0, self.text, 0, len(self.text))

    def _sendable(self, unsent: str, is_final: bool) -> tuple[int, bool]:
        """How much of the unsent text may go now, and whether a stop string ends the output there."""
        if not self.stop or len(self.ids) <= self.min_tokens:
            return len(unsent), False
        cut = find_stop(unsent, self.stop)
        if cut is not None:
            return cut, True
        return len(unsent) - (0 if is_final else stop_prefix_length(unsent, self.stop)), False

    def _advance(self) -> None:
        sent_points = [p for p in self.whole_points if p[1] <= self.sent]
        if not sent_points:
            return
        ids, chars = sent_points[-1]
        self.prefix_offset, self.read_offset, self.sent = self.read_offset, ids, self.sent - chars
        self.whole_points = [(i, c - chars) for i, c in self.whole_points if i > ids]
