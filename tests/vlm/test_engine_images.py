"""The engine with images: log-probs equal the trainer's forward, images never share prefix KV, bad requests fail."""

import asyncio

import pytest
import torch
from vlm_support import IMAGE_ID, PER_IMAGE, image, small_vlm

from molt.engine import SamplingParams, TorchEngine
from molt.models.vision import ImageError, to_pixels
from molt.train.packing import pack
from molt.train.trainer import token_logprobs

PROMPT = [10, 11] + [IMAGE_ID] * PER_IMAGE + [12, 13, 14] + [IMAGE_ID] * PER_IMAGE + [15]
RED, BLUE, GREEN = (to_pixels(image(c), 16) for c in [(220, 20, 20), (20, 20, 220), (20, 200, 20)])


def trainer_side(model, prompt, generated, pixels):
    """The trainer's log-probs of `generated` after `prompt`, through packing and `token_logprobs`."""
    ids = prompt + generated
    (batch,) = pack([ids], [[0] * len(prompt) + [1] * len(generated)], len(ids), 4096, [pixels])
    with torch.no_grad():
        logp = token_logprobs(model, batch, temperature=1.0)[0]
    return logp[len(prompt) - 1 : len(ids) - 1]


@pytest.mark.parametrize("budget", [2048, 5])  # 5: prefill chunks end inside images
def test_engine_logprobs_with_images_match_the_trainer(budget):
    model = small_vlm()
    engine = TorchEngine(model, num_slots=4, max_seq_len=64, max_num_batched_tokens=budget, eos_token_ids=())
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)
    outs = asyncio.run(engine.generate_group(PROMPT, sampling, images=[RED, BLUE]))
    for out in outs:
        ref = trainer_side(model, PROMPT, out.token_ids, [RED, BLUE])
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0), (out.logprobs, ref)
        assert IMAGE_ID not in out.token_ids
    asyncio.run(engine.close())


def test_equal_ids_with_different_images_never_share_kv():
    model = small_vlm()
    engine = TorchEngine(model, num_slots=4, max_seq_len=64, prefix_cache=True, eos_token_ids=())
    greedy = SamplingParams(temperature=0, max_tokens=6)
    first = asyncio.run(engine.generate(PROMPT, greedy, images=[RED, BLUE]))
    second = asyncio.run(engine.generate(PROMPT, greedy, images=[GREEN, BLUE]))
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    fresh = TorchEngine(small_vlm(), num_slots=4, max_seq_len=64, eos_token_ids=())
    alone = asyncio.run(fresh.generate(PROMPT, greedy, images=[GREEN, BLUE]))
    assert second.token_ids == alone.token_ids and second.logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    assert first.logprobs != pytest.approx(second.logprobs, abs=1e-6)  # the image matters
    for e in (engine, fresh):
        asyncio.run(e.close())


def test_image_requests_that_do_not_match_their_placeholders_fail_clearly():
    engine = TorchEngine(small_vlm(), num_slots=2, max_seq_len=64, eos_token_ids=())
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ImageError, match="2 image placeholder runs .* but 1 images"):
        asyncio.run(engine.generate(PROMPT, greedy, images=[RED]))
    with pytest.raises(ImageError, match="not a multiple"):
        asyncio.run(engine.generate([1, IMAGE_ID, 2], greedy, images=[RED]))
    with pytest.raises(ImageError, match="cannot decode"):
        asyncio.run(engine.generate(PROMPT, greedy, images=[RED, b"junk"]))
    ok = asyncio.run(engine.generate(PROMPT, greedy, images=[RED, BLUE]))  # the engine still serves
    assert ok.finish_reason == "length"
    asyncio.run(engine.close())
