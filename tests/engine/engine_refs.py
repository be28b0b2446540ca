"""Shared references for the engine tests: prompts, trainer-side log-probs, a weight swap while decoding (the tiny
random-weight HF models are `random_hf` and `random_hf_in_molt` in tests/conftest.py)."""

import asyncio

import torch
from conftest import TINY_HF  # noqa: I001 - tests/conftest.py

VOCAB = TINY_HF["vocab_size"]


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def trainer_logprobs(model, prompt, completion, temperature):
    """What the trainer computes: log_softmax(logits / T) of the full sequence at the sampled ids."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1] / (temperature or 1.0)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]


async def swap_while_decoding(engine, new, ps, sampling, after_tokens=12):
    """Generate `ps` and, once `after_tokens` more tokens are decoded, swap in `new` (version 1, interrupt)."""
    start = engine.stats["decode_tokens"]
    tasks = [asyncio.create_task(engine.generate(p, sampling)) for p in ps]
    while engine.stats["decode_tokens"] < start + after_tokens:
        await asyncio.sleep(0.001)
    await engine.update_weights(dict(new.state_dict()), version=1, mode="interrupt")
    return await asyncio.gather(*tasks)


def assert_old_then_new(old, new, ps, outs, max_tokens):
    """Each completion switched versions mid-way; log-probs before are `old`'s, after are `new`'s (1e-5)."""
    for p, out in zip(ps, outs, strict=True):
        switch = out.versions.index(1)
        assert 0 < switch < max_tokens
        lp = torch.tensor(out.logprobs)
        assert (lp[:switch] - trainer_logprobs(old, p, out, 1.0)[:switch]).abs().max() <= 1e-5
        assert (lp[switch:] - trainer_logprobs(new, p, out, 1.0)[switch:]).abs().max() <= 1e-5
