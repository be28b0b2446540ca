"""Incremental detokenization of one streamed sample: the text that is safe to send so far.

Sent text is always a prefix of the reply's final text: a trailing partial UTF-8 character (decoded as
U+FFFD: the last MAX_PARTIAL tokens wait) is held back, and so is any suffix that could be the start of a
stop string; once a stop string appears, the text ends before it (stop strings are never sent, as
OpenAI and Anthropic do).
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"
MAX_PARTIAL = 3  # tokens a partial UTF-8 character can span (byte-level vocabularies)


def trim_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` cut before the earliest stop string it contains, and that stop string (or None)."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    index, stop = min(hits)
    return text[:index], stop


class TextStream:
    """Feed generated ids with `push`; each call returns the new text that can be sent."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids += token_ids
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text, stop = trim_at_stop(text, self.stops)
        if stop is not None:
            self.stopped = True
        else:
            if text.endswith(REPLACEMENT):  # maybe a character still being spelled out: its last bytes wait
                text = self.tokenizer.decode(self.ids[:-MAX_PARTIAL], skip_special_tokens=True)
            text = text[: len(text) - self._held(text)]
        if not text.startswith(self.sent):  # the decoding of a longer prefix changed earlier text: wait
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)  # fmt: skip
