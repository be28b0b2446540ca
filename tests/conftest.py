"""Shared test fixtures: one local Ray cluster per session, the tiny Molt model, engine-like batches, a
recording wrapper around an engine, and a base for fake engines. Test modules import the helpers with
`from conftest import ...`.
"""

import os
import random

import pytest
import torch
import torch.nn.functional as F

from molt.data.trajectory import Trajectory
from molt.engine.interface import Engine
from molt.models import Transformer, preset


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=env, log_to_driver=False)
    yield ray
    ray.shutdown()


def small_model(seed: int = 0, kind: str = "dense", std: float = 0.05, **sizes) -> Transformer:
    """The tiny Molt model of the unit tests (random weights of std `std`): dense, or `kind="moe"`."""
    kw = dict(vocab_size=64, hidden_size=64, num_layers=2, head_dim=16)
    moe = kind == "moe"
    kw |= (dict(moe_intermediate_size=32) if moe else dict(intermediate_size=128)) | sizes
    arch = preset("tiny-moe" if moe else "tiny", **kw)
    return Transformer(arch).init_weights(std, torch.Generator().manual_seed(seed))


@torch.no_grad()
def batch(model, num_groups=4, n=4, seed=0):
    """Complete groups of random engine-like trajectories with their true rollout log-probs."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        for k in range(n):
            traj = Trajectory(group_id=g, rollout_id=g * n + k, reward=float(rng.random() < 0.5))
            traj.extend_prompt([rng.randrange(64) for _ in range(rng.randint(3, 9 + 8 * g))])
            ids = [rng.randrange(64) for _ in range(rng.randint(2, 7))]
            traj.extend_action(ids, [0.0] * len(ids), [0] * len(ids))
            logits = model(torch.tensor([traj.tokens]))[0]
            lp = F.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(traj.tokens[1:])[:, None])[:, 0]
            traj.rollout_logprobs = [x if m else 0.0 for x, m in zip([0.0, *lp.tolist()], traj.loss_mask, strict=True)]
            out.append(traj)
    return out


class RecordingEngine:
    """Wraps a real engine and keeps every (prompt ids, emitted ids) pair it served."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, prompt_ids, sampling, **kw):
        completion = await self.engine.generate(prompt_ids, sampling, **kw)
        self.calls.append((tuple(prompt_ids), tuple(completion.token_ids)))
        return completion

    def __getattr__(self, name):
        return getattr(self.engine, name)


class IdleEngine(Engine):
    """A fake engine's base: every control call does nothing (abort finds nothing, a weight update only sets the
    version, nothing pending); subclasses give `generate_group` and override what they record."""

    version = 0

    async def abort(self, request_id):
        return False

    async def update_weights(self, weights, version, mode="interrupt"):
        self.version = version

    async def pause(self):
        pass

    async def resume(self):
        pass

    def num_pending(self):
        return 0
