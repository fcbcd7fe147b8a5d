"""From generated token ids to streamed text: incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalDetokenizer:
    """Emits text only once it is stable.

    Decoding token by token breaks multi-byte characters split over tokens and the
    tokenizer's handling of leading spaces, so each step decodes a short window
    (`prefix` .. end) and emits what it adds beyond the window's already-emitted part.
    A window that ends in U+FFFD (an unfinished UTF-8 sequence) is held until complete.

    `context`: tokens the text continues (a prompt's last ones), decoded in the first window but never
    emitted, so that the first token's text is what it adds to them: a SentencePiece tokenizer drops
    the leading space of a text's first word, which a completion of "The capital of France is" needs.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()) -> None:
        self.decode = decode  # ids → text, special tokens skipped
        self.ids: list[int] = list(context)
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # tokens up to here have been emitted (or are the context)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        emitted = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids) if ids else ""


class StopStringMatcher:
    """Cuts the text at the first stop string, which may span several tokens.

    Text that could still be the start of a stop string is held back, so a stop string
    is never emitted, not even in part.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string that was hit (APIs that report it: Anthropic's)

    def feed(self, text: str) -> tuple[str, bool]:
        """→ (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [(at, stop) for stop in self.stops if (at := self.pending.find(stop)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])  # the earliest; of those, the first listed
            out, self.pending = self.pending[:at], ""
            return out, True
        keep = self._longest_partial_stop()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _longest_partial_stop(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best
