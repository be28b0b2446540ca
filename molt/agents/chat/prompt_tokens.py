"""Prompt tokens within a context budget: a lower bound on a text's tokens from its length (`min_tokens`), and
encoding megabytes of prompt in a worker thread without stalling the event loop (`encode_within`). A prompt
that cannot fit raises `OverContext` with its (lower-bound or exact) token count."""

from __future__ import annotations

import weakref

from molt.models.tokenizer import stock_fast


class OverContext(Exception):  # noqa: N818 - a signal inside the session, never raised to a caller
    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens


_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def min_tokens(tokenizer, num_chars: int) -> int:
    """A lower bound on the tokens of any `num_chars` characters of text: a token spells at most its longest
    vocabulary entry's characters, and normalizers (NFC, NFKC) shrink text at most ~3x (4 to be safe).
    0 for a tokenizer with an unknown token (one can stand for a whole word)."""
    if getattr(tokenizer, "unk_token", None) is not None or not hasattr(tokenizer, "get_vocab"):
        return 0
    try:
        longest = _MAX_TOKEN_CHARS.get(tokenizer) or max(map(len, tokenizer.get_vocab()), default=1)
        _MAX_TOKEN_CHARS[tokenizer] = longest
    except TypeError:  # not weak-referenceable: no bound
        return 0
    return num_chars // (4 * longest)


def encode_within(tokenizer, text: str, max_tokens: int) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)` of megabytes of text in a worker thread, raising
    OverContext (the exact count) when it has `max_tokens` or more, without converting its ids.

    transformers' `encode` converts ids, type ids and attention mask to Python lists holding the GIL (the
    event loop stalls), so a fast tokenizer in its stock state is called directly: `encode_batch_fast` (the
    same ids, no offsets) releases the GIL. Other tokenizers take the plain `encode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        stock_fast(tokenizer, "_encode_plus")
        and backend.truncation is None
        and backend.padding is None
        and (backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))
    ):
        # an Encoding: its ids are converted only if they fit
        (ids,) = backend.encode_batch_fast([text], add_special_tokens=False)
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) >= max_tokens:
        raise OverContext(len(ids))
    return getattr(ids, "ids", ids)  # an Encoding's ids, or the list
