"""Shared references for the engine tests: random-weight HF tiny models, prompts, trainer-side log-probs."""

import asyncio

import torch
import transformers
from conftest import packed_trainer_logprobs  # noqa: F401 - tests/conftest.py; re-exported

from molt.models import from_pretrained

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**COMMON),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True
    ),
}


def random_hf(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """Random weights of std 0.2 (logits of a few units; at 0.3, fp32 noise alone nears 1e-5 in log-prob)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in pname else 0.1) + (1.0 if "norm" in pname else 0.0))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def trainer_logprobs(model, prompt, completion, temperature):
    """What the trainer computes: log_softmax(logits / T) of the full sequence at the sampled ids."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1] / (temperature or 1.0)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def molt_model(name: str, folder, seed: int = 0):
    """A random HF model of config `name`, saved to `folder` and loaded into Molt."""
    random_hf(name, seed).save_pretrained(folder)
    return from_pretrained(folder).eval()


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
