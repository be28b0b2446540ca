"""A learned reward model as the reward (RLHF): `molt train --data.path prompts.jsonl --rollout.reward
examples/reward_model.py:score` with `MOLT_REWARD_MODEL=/path/to/rm`, a local Hugging Face folder of a sequence
classification model with one output (a Bradley-Terry reward model saved with `save_pretrained`; never downloaded).

The model loads once per process on its first call (rewards run on threads, so behind a lock; with agent workers, once
per worker), on `MOLT_REWARD_DEVICE` (default: the GPU if there is one). It scores the row's prompt messages followed
by the completion as the assistant's turn, rendered with the reward model's own chat template (its tokenizer's, which
need not be the policy's), truncated on the left to its context. Name the parts with a dict to log them beside others
(`--rollout.reward math,examples/reward_model.py:score --rollout.reward_weights score=0.5`).
"""

from __future__ import annotations

import os
import threading

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from molt.agents.env import prompt_messages

_LOCK = threading.Lock()
_LOADED: dict = {}


def _reward_model() -> dict:
    """The tokenizer, model and device of `MOLT_REWARD_MODEL`, loaded on the first call."""
    with _LOCK:
        if not _LOADED:
            path = os.environ.get("MOLT_REWARD_MODEL")
            if not path or not os.path.isdir(path):
                raise RuntimeError(f"MOLT_REWARD_MODEL={path!r}: set it to a local reward model folder")
            device = os.environ.get("MOLT_REWARD_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
            tokenizer = AutoTokenizer.from_pretrained(path, truncation_side="left")
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype="auto").to(device).eval()
            if model.config.num_labels != 1:
                raise RuntimeError(f"{path}: a reward model has one output, this one {model.config.num_labels}")
            _LOADED.update(tokenizer=tokenizer, model=model, device=device)
    return _LOADED


def render(tokenizer, messages: list[dict]) -> str:
    """The conversation as the reward model reads it (a text model: a message's text parts, an image as `[image]`):
    its chat template, else the turns one per line."""
    messages = [m | {"content": _text(m.get("content"))} for m in messages]
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _text(content) -> str:
    if not isinstance(content, list):
        return content or ""
    return "".join(p.get("text", "") if p.get("type") == "text" else "[image]" for p in content if isinstance(p, dict))


@torch.no_grad()
def score(completion: str, row: dict) -> float:
    """The reward model's score of the completion as the answer to the row's prompt."""
    rm = _reward_model()
    messages = [*prompt_messages(row["messages"]), {"role": "assistant", "content": completion}]
    context = min(rm["tokenizer"].model_max_length, getattr(rm["model"].config, "max_position_embeddings", 1 << 30))
    inputs = rm["tokenizer"](render(rm["tokenizer"], messages), return_tensors="pt", truncation=True,
                             max_length=context, add_special_tokens=not rm["tokenizer"].chat_template)  # fmt: skip
    with _LOCK:  # one forward at a time on the shared model
        return float(rm["model"](**inputs.to(rm["device"])).logits[0, 0])
