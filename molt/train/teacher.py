"""The on-policy distillation teacher (`--algo.teacher PATH`): a frozen HF model scoring the sampled tokens.

The teacher reads the same packed rows as the policy and gives log p_teacher(token) at every trained token, in
the same layout as the policy's log-probs (`molt.train.logprobs.token_logprobs`, chunked LM head, fp32
log-softmax at the rollout temperature), without gradients. It may differ from the policy in size and in
dense/MoE (an MoE teacher routes live: nothing is replayed); it must share the tokenizer. Knows models and
the packed layout; nothing of advantages or the loop."""

from __future__ import annotations

import torch

from molt.config import ConfigError
from molt.models import Transformer, from_pretrained
from molt.train.logprobs import token_logprobs
from molt.train.packing import PackedBatch


def load_teacher(path: str, policy: Transformer, device: str, dtype: torch.dtype) -> Transformer:
    """The teacher from an HF folder, frozen in `dtype` (the compute dtype: it never trains)."""
    teacher = from_pretrained(path, dtype=dtype, device=device).eval().requires_grad_(False)
    if teacher.cfg.vision is None and policy.cfg.vision is not None:
        raise ConfigError(f"algo.teacher: the policy reads images but {path} has no vision tower")
    return teacher


@torch.no_grad()
def teacher_logprobs(teacher: Transformer, packed: PackedBatch, temperature: float, chunk_tokens: int):
    """log p_teacher(target) at every packed position (the layout of `token_logprobs`); 0 off the trained ones."""
    top = int(packed.input_ids.max()) if packed.input_ids.numel() else 0
    if top >= teacher.cfg.vocab_size:
        raise ValueError(
            f"algo.teacher: token id {top} is outside the teacher's vocabulary ({teacher.cfg.vocab_size}); "
            "teacher and policy must share the tokenizer"
        )
    return token_logprobs(teacher, packed, temperature, None, True, chunk_tokens)
