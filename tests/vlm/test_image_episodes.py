"""Images through Env episodes into the trainer: the right pixels at the right positions, bad images dropped."""

import asyncio

import pytest
import torch
from vlm_support import IMAGE_ID, PER_IMAGE, TOK, image, png_bytes, small_vlm

from molt.agents.env import Env, Result
from molt.agents.images import ImageBudgetError
from molt.agents.runner import EpisodeLimits, run_episode
from molt.config import Config
from molt.engine import SamplingParams, TorchEngine
from molt.models.vision import ImageError, pixel_hash, to_pixels
from molt.train.batch import ImageMismatchError
from molt.train.trainer import Trainer, token_logprobs

FIRST, SECOND = image((230, 30, 30)), image((30, 30, 230))


class LookTwice(Env):
    """Turn 1: text only, answers with an image (`Result.images`); turn 2: ends."""

    async def step(self, action: str) -> Result:
        if not getattr(self, "shown", False):
            self.shown = True
            return Result(reward=0.0, observation="and this one?", images=[png_bytes(SECOND)])
        return Result(reward=1.0, terminated=True)


def _episode(engine, row, max_len=256):
    sampling = SamplingParams(temperature=1.0, max_tokens=5, seed=11)
    limits = EpisodeLimits(max_turns=3, max_len=max_len)
    return asyncio.run(run_episode(engine, TOK, LookTwice(), row, sampling, limits, rollout_id=0, group_id=0))


def test_an_image_added_in_turn_two_trains_with_its_pixels_at_its_positions():
    model = small_vlm()
    engine = TorchEngine(model, num_slots=4, max_seq_len=256, max_num_batched_tokens=7, eos_token_ids=())
    row = {
        "messages": [{"role": "user", "content": [{"type": "image", "image": FIRST}, {"type": "text", "text": "hm"}]}]
    }
    traj = _episode(engine, row)
    runs = [i for i, t in enumerate(traj.tokens) if t == IMAGE_ID and (i == 0 or traj.tokens[i - 1] != IMAGE_ID)]
    assert [r["start"] for r in traj.images] == runs and len(runs) == 2
    first_action = traj.actions[0]
    assert runs[0] < first_action[0] < first_action[1] <= runs[1]  # the second image came after turn 1
    assert all(traj.tokens[s : s + PER_IMAGE] == [IMAGE_ID] * PER_IMAGE for s in runs)
    expected = [pixel_hash(to_pixels(FIRST, 16)), pixel_hash(to_pixels(SECOND, 16))]
    assert [r["hash"] for r in traj.images] == expected

    trainer = Trainer(model, Config())
    (mb,) = trainer.micro_batches([traj])
    assert [pixel_hash(p) for p in mb.packed.pixel_values] == expected
    with torch.no_grad():
        logp = mb.unpack(token_logprobs(model, mb.packed, 1.0))[0]
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    assert torch.allclose(logp[mask], torch.tensor(traj.rollout_logprobs)[mask], atol=1e-5, rtol=0)

    traj.images[1]["pixels"] = to_pixels(FIRST, 16)  # pixels that are not what the engine saw
    with pytest.raises(ImageMismatchError, match="differs from the engine's"):
        trainer.micro_batches([traj])
    asyncio.run(engine.close())


def test_bad_images_are_clear_errors_and_images_over_the_budget_are_dropped(tmp_path):
    engine = TorchEngine(small_vlm(), num_slots=2, max_seq_len=256, eos_token_ids=())

    def row(*images):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": im} for im in images]}]}

    with pytest.raises(ImageError, match="image 0: cannot decode"):
        _episode(engine, row(b"not an image"))
    with pytest.raises(ImageError, match="does not exist"):
        _episode(engine, row(str(tmp_path / "nope.png")))
    with pytest.raises(ImageBudgetError, match="past the context budget max_len=20") as err:
        _episode(engine, row(FIRST, FIRST, FIRST, FIRST, FIRST), max_len=20)
    assert err.value.drop_reason == "image_over_context"
    # the second turn's image observation ends where the second action begins: counted with its image expanded, it
    # leaves no room to act at that budget, so the episode ends before it (its placeholder counted as one token
    # let it in, and an image observation could pass the budget)
    budget = _episode(engine, row(FIRST)).actions[1][0]
    cut = _episode(engine, row(FIRST), max_len=budget)
    assert cut.truncated and len(cut.images) == 1 and len(cut.tokens) < budget and cut.loss_mask[-1] == 1
    asyncio.run(engine.close())
