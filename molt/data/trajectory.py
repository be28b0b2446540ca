"""The token-first record that crosses from rollout to trainer.

One `Trajectory` is one segment of one rollout: the exact token ids (prompt, generated actions and
observations in order), a loss mask that is 1 only on engine-generated tokens, and per-token rollout
log-probs and weight versions (0.0 / -1 where the engine did not sample the token). A rollout
that its agent rewrote mid-way has several segments sharing `rollout_id` and reward. Plain lists,
serialisable with `to_dict` / `from_dict`; nothing here knows about engines or trainers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

NOT_SAMPLED = -1


@dataclass
class Trajectory:
    """Tokens and per-token rollout facts of one segment, plus its rollout's outcome."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    score: float | None = None
    group_id: int = 0
    rollout_id: int = 0
    segment: int = 0
    num_segments: int = 1
    finish_reason: str = ""
    truncated: bool = False
    num_turns: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    images: list[Any] | None = None
    routing: Any = None  # MoE: int tensor [<= len(tokens), MoE layers, k] expert ids by position; -1 = none
    # one entry per engine action: (start, end, hash of the emitted ids, the ids themselves or None)
    actions: list[tuple[int, int, int, list[int] | None]] = field(default_factory=list)

    def extend_prompt(self, ids: list[int]) -> None:
        """Append tokens the policy did not generate (prompt, observations): mask 0."""
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)
        self.versions += [NOT_SAMPLED] * len(ids)

    def extend_action(
        self, ids: list[int], logprobs: list[float], versions: list[int], keep_copy: bool = False
    ) -> None:
        """Append engine-generated tokens with their sampling log-probs and versions: mask 1.

        The action's span and a hash of the emitted ids are recorded so the trainer can verify
        that exactly these tokens, and only these, are trained (`keep_copy` keeps the ids too)."""
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"action of {len(ids)} tokens has {len(logprobs)} logprobs, {len(versions)} versions")
        start = len(self.tokens)
        self.actions.append((start, start + len(ids), hash(tuple(ids)), list(ids) if keep_copy else None))
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.rollout_logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.num_turns += 1

    def add_routing(self, routing) -> None:
        """Merge an engine's per-position expert ids [n, L, k] (-1 = no record) into `routing`.

        An engine reports the routing of its whole context (prompt + generated), so a later turn's
        record replaces an earlier one where it has one: each position keeps the routing of the last
        forward that computed its KV in this rollout (identical unless the weights changed between)."""
        if routing is None:
            return
        old = self.routing if self.routing is not None else routing[:0]
        if old.shape[1:] != routing.shape[1:]:
            raise ValueError(f"rollout {self.rollout_id}: routing shape {tuple(routing.shape[1:])} != {old.shape[1:]}")
        merged = routing.new_full((max(len(old), len(routing)), *routing.shape[1:]), -1)
        merged[: len(old)] = old
        merged[: len(routing)] = routing.where(routing >= 0, merged[: len(routing)])
        self.routing = merged

    @property
    def num_action_tokens(self) -> int:
        return sum(self.loss_mask)

    def min_version(self) -> int:
        """Oldest weight version among the generated tokens (NOT_SAMPLED if none)."""
        sampled = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(sampled) if sampled else NOT_SAMPLED

    def check(self) -> None:
        """Structural invariants: aligned lists, mask 1 exactly where a version was recorded."""
        n = len(self.tokens)
        if not (len(self.loss_mask) == len(self.rollout_logprobs) == len(self.versions) == n):
            raise ValueError(f"rollout {self.rollout_id}: per-token lists are not aligned with {n} tokens")
        if self.routing is not None and len(self.routing) > n:
            raise ValueError(f"rollout {self.rollout_id}: routing has {len(self.routing)} positions for {n} tokens")
        for i, (m, v) in enumerate(zip(self.loss_mask, self.versions, strict=True)):
            if (m == 1) != (v != NOT_SAMPLED):
                raise ValueError(f"rollout {self.rollout_id} token {i}: mask {m} but version {v}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(**(data | {"actions": [tuple(a) for a in data.get("actions", [])]}))
