"""Streaming text: incremental detokenization and stop-string matching.

Both are pushed one increment at a time and release only text that can no
longer change: `IncrementalDetokenizer` holds back an incomplete UTF-8
character, `StopStringMatcher` holds back a suffix that could still become a
stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (services.tokenizer.Tokenizer)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete text.

    The concatenation of every `push` and the final `flush` equals
    `tokenizer.decode(all_ids, skip_special_tokens)`.

    Each push decodes a short window of ids: `ids[prefix_offset:]` against
    `ids[prefix_offset:read_offset]`, the part already released. `read_offset`
    only moves to a point where the decoded text did not end in U+FFFD, that
    is where the bytes end on a complete character; decoding is therefore
    additive across that point, and the prefix window gives tokenizers whose
    decoding depends on the previous token (leading spaces) their context.
    """

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: Iterable[int]) -> str:
        """Add ids; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text, text = self._decode_window()
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """Release what is held back, incomplete characters as U+FFFD."""
        prefix_text, text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix_text):]

    def _decode_window(self) -> tuple[str, str]:
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        window = self._ids[self._prefix_offset:]
        prefix_text = decode(window[:self._read_offset - self._prefix_offset], skip)
        text = decode(window, skip)
        assert text.startswith(prefix_text), (prefix_text, text)
        return prefix_text, text


class StopStringMatcher:
    """Finds stop strings in streamed text.

    `push` returns the text that is safe to release and the stop string that
    ended the text, if any. When several stop strings occur, the one that is
    completed first (the smallest end position, then the longest) wins: that
    is where character-by-character generation would have stopped. The stop
    string itself and anything after it are never released.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not stop for stop in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        self._stops = tuple(stops)
        self._max_len = max((len(s) for s in stops), default=0)
        self._held = ""
        self.matched_stop: str | None = None

    def push(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text to release, matched stop string or None)."""
        if self.matched_stop is not None:
            raise RuntimeError(f"pushed after the stop string {self.matched_stop!r} matched")
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held, self.matched_stop = "", stop
            return buffer[:start], stop
        num_held = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - num_held:]
        return buffer[:len(buffer) - num_held], None

    def flush(self) -> str:
        """Release the held-back text at the end of generation."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None    # (end, -len, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that starts a stop string."""
        for n in range(min(len(buffer), self._max_len - 1), 0, -1):
            suffix = buffer[len(buffer) - n:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return n
        return 0
