"""Ids the chat server hands out (sessions, responses, tool calls): unguessable, unique, and cheap."""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets

_ID_KEY, _ID_COUNTER = secrets.token_bytes(32), itertools.count()


def _rekey() -> None:
    global _ID_KEY
    _ID_KEY = secrets.token_bytes(32)


os.register_at_fork(after_in_child=_rekey)  # a forked child must not repeat its parent's ids


def new_id(prefix: str = "", num_bytes: int = 12) -> str:
    """An unguessable unique id: a keyed hash of a per-process counter (one `os.urandom` per process, not
    per id: it can take ~1 ms on a loaded machine)."""
    digest = hashlib.blake2b(next(_ID_COUNTER).to_bytes(8, "little"), key=_ID_KEY, digest_size=num_bytes)
    return prefix + digest.hexdigest()
