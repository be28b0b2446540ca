"""Incremental detokenization of one streamed sample: the text that is safe to send so far.

Sent text is always a prefix of the reply's final text: a trailing partial UTF-8 character (U+FFFD) is held back, and so
is any suffix that could start a stop string; once a stop string appears, the text ends before it (stop strings are
never sent, as OpenAI and Anthropic do).

Each push decodes only the tokens since the last checkpoint plus the WINDOW before it (a full decode per delta makes a
long stream quadratic): the text is `head` + the window's decoding while that still starts with `known`, the window's
decoding at the checkpoint (else a full decode). Detokenizers act locally (byte-level; metaspace strips a leading space
only at a decode's start, which the window's decodes share), so this is the full decode's text."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from molt.models.tokenizer import stock_fast

REPLACEMENT = "\ufffd"
MAX_PARTIAL = 3  # tokens a partial UTF-8 character can span (byte-level vocabularies)
WINDOW = 32  # tokens decoded again before the checkpoint, which moves every WINDOW tokens


def trim_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` cut before the earliest stop string it contains, and that stop string (or None)."""
    index, stop = min(((i, s) for s in stops if (i := text.find(s)) >= 0), default=(len(text), None))
    return text[:index], stop


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`; for a stock fast tokenizer that cleans up no spaces,
    the Rust backend's decode it would call (~5x faster, once per streamed delta)."""
    if stock_fast(tokenizer, "decode", "_decode") and not tokenizer.clean_up_tokenization_spaces:
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


class TextStream:
    """Feed generated ids with `push`; each call returns the new text that can be sent. `opener`: the text that
    opens a tool call, where the text stops (the calls go out parsed, at the end), its space before held back."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), opener: str | None = None):
        self.decode, self.stops, self.calls = decoder(tokenizer), (*stops, *filter(None, [opener])), bool(opener)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        # checkpoint: the text of ids[:mark] is head + the window's text of ids[start:mark]
        self.start = self.mark = 0
        self.head = self.known = ""

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids += token_ids
        if self.stopped:
            return ""
        text, stop = trim_at_stop(self._text(self.ids), self.stops)
        self.stopped = stop is not None
        if not self.stopped:
            if text.endswith(REPLACEMENT):  # maybe a character still being spelled out: its last bytes wait
                text = self._text(self.ids[:-MAX_PARTIAL])
            elif len(self.ids) - self.mark >= WINDOW:
                self._checkpoint(text)
            text = text[: len(text) - self._held(text)]
        if self.calls:  # space before a call is not content (`tool_parser`); it goes out with what follows it
            text = text.rstrip()
        if not text.startswith(self.sent):  # the decoding of a longer prefix changed earlier text: wait
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def _text(self, ids: list[int]) -> str:
        """The decoded text of `ids` (which extend ids[:mark])."""
        window = self.decode(ids[self.start :])
        if window.startswith(self.known):
            return self.head + window
        return self.decode(ids)  # the window's start decodes differently here: decode it all

    def _checkpoint(self, text: str) -> None:
        """`text` (complete: no partial character) is that of all ids so far; the window restarts before them,
        unless its own decoding is not a suffix of `text` (it starts inside a character): then the next push
        tries again, from a later start."""
        start = len(self.ids) - WINDOW
        known = self.decode(self.ids[start:])
        if text.endswith(known):
            self.start, self.mark, self.head, self.known = start, len(self.ids), text[: len(text) - len(known)], known

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)  # fmt: skip
