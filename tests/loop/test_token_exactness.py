"""Independent check of token exactness: record what the real engine emitted, compare with what was trained."""

import asyncio
import copy
import dataclasses

from conftest import RecordingEngine  # noqa: I001 - tests/conftest.py

from molt.agents.builtin import env_for_task
from molt.cli.build import build_model, build_tokenizer
from molt.cli.main import parse_config
from molt.cli.warm_start import warm_start
from molt.data.tasks import get_task
from molt.engine import TorchEngine
from molt.loop.rl import RLLoop
from molt.train.trainer import Trainer


class RecordingTrainer(Trainer):
    def step(self, trajs):
        self.trained = getattr(self, "trained", []) + copy.deepcopy(trajs)
        return super().step(trajs)


def test_trained_tokens_are_exactly_the_engine_outputs():
    cfg = parse_config(["--rollout.prompts_per_step", "2",
                        "--rollout.n_samples_per_prompt", "3", "--rollout.max_tokens", "12",
                        "--rollout.max_turns", "3", "--rollout.filters", "nonfinite", "--train.max_steps", "3",
                        "--train.warmup_steps", "0", "--eval.every", "0"])  # fmt: skip
    policy = dataclasses.replace(cfg.model, path=warm_start(cfg))  # the cached warm start: it calls the tool
    tokenizer = build_tokenizer(policy)
    model = build_model(policy, tokenizer, seed=0)
    engine = RecordingEngine(TorchEngine(copy.deepcopy(model), tokenizer=tokenizer, num_slots=16, max_seq_len=256))
    trainer = RecordingTrainer(model, cfg)
    rows = get_task("calculator").rows(32, seed=0)
    loop = RLLoop(cfg, engine=engine, trainer=trainer, tokenizer=tokenizer,
                  make_env=lambda: env_for_task("calculator"), train_rows=rows, eval_rows=rows[:4])  # fmt: skip

    async def main():
        try:
            await loop.run()
        finally:
            await engine.close()

    asyncio.run(main())
    calls = set(engine.calls)
    assert len(trainer.trained) == 3 * 6
    multi_turn = 0
    for traj in trainer.trained:
        mask = traj.loss_mask + [0]
        starts = [i for i in range(1, len(traj.tokens)) if mask[i] and not mask[i - 1]]
        ends = [i for i in range(1, len(mask)) if mask[i - 1] and not mask[i]]
        assert starts and len(starts) == len(ends), "every episode has at least one action"
        for start, end in zip(starts, ends, strict=True):
            # the engine was asked for exactly this context and emitted exactly these ids (mask 1 only there)
            assert (tuple(traj.tokens[:start]), tuple(traj.tokens[start:end])) in calls
        multi_turn += len(starts) > 1
    assert multi_turn > 0
