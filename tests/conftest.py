"""Shared test fixtures: one local Ray cluster per session, the flags of a tiny run, the tiny Molt model, tiny
random-weight `transformers` models (and the same weights loaded into Molt), engine-like trajectories with their
true log-probs, the trainer tests' config, the `molt` CLI run in process, a recording wrapper around an engine,
and a base for fake engines. Test modules import the helpers with `from conftest import ...`.
"""

import asyncio
import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from molt.data.trajectory import Trajectory
from molt.engine.interface import Engine
from molt.models import Transformer, from_pretrained, preset

# a tiny RL run of the preset, not warm-started (tests add steps, data and eval; of a repeated flag the last wins)
TINY_RUN = [
    "--model.preset", "tiny", "--model.warmstart_steps", "0", "--rollout.prompts_per_step", "2",
    "--rollout.n_samples_per_prompt", "4", "--rollout.max_tokens", "6", "--rollout.filters", "nonfinite",
    "--eval.every", "0", "--train.warmup_steps", "0", "--log.every", "100",
]  # fmt: skip


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


# the engine tests' tiny `transformers` architecture (Qwen3; `hf_config("qwen3-moe")` adds 4 experts, top 2)
TINY_HF = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=12, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
TINY_HF_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)


def hf_config(name: str = "qwen3", **overrides):
    """The tiny `transformers` config `qwen3` (dense) or `qwen3-moe`, with `overrides`."""
    import transformers

    if name == "qwen3-moe":
        return transformers.Qwen3MoeConfig(**TINY_HF | TINY_HF_MOE | overrides)
    return transformers.Qwen3Config(**TINY_HF | overrides)


def random_hf(config="qwen3", seed: int = 0, std: float = 0.2):
    """A `transformers` causal LM of `config` (a config, or an `hf_config` name): fp32, eager attention, eval mode,
    random weights of std `std` (norm weights 1 + std 0.1), `generate` without EOS. At std 0.2 logits are a few
    units; at 0.3 fp32 noise alone nears 1e-5 in log-prob."""
    import transformers

    config = hf_config(config) if isinstance(config, str) else config
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else std) + (1.0 if "norm" in name else 0.0))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def random_hf_in_molt(config, folder, seed: int = 0) -> Transformer:
    """`random_hf(config, seed)` saved to `folder` and loaded into Molt (the same weights)."""
    random_hf(config, seed).save_pretrained(folder)
    return from_pretrained(folder).eval()


@torch.no_grad()
def true_logprobs(model, tokens: list[int], temperature: float = 1.0) -> list[float]:
    """What the trainer computes for `tokens` (0.0 at the first): log_softmax(logits / T) at the next ids."""
    logits = model(torch.tensor([tokens]))[0].float() / temperature
    lp = F.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0, *lp.tolist()]


def with_true_logprobs(traj: Trajectory, model, temperature: float = 1.0) -> Trajectory:
    """`traj` with its rollout log-probs set to the model's own at its generated tokens (0.0 elsewhere)."""
    lp = true_logprobs(model, traj.tokens, temperature)
    traj.rollout_logprobs = [x if m else 0.0 for x, m in zip(lp, traj.loss_mask, strict=True)]
    return traj


def batch(model, num_groups=4, n=4, seed=0):
    """Complete groups of random engine-like single-turn trajectories with their true rollout log-probs."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        for k in range(n):
            traj = Trajectory(group_id=g, rollout_id=g * n + k, reward=float(rng.random() < 0.5))
            traj.extend_prompt([rng.randrange(64) for _ in range(rng.randint(3, 9 + 8 * g))])
            ids = [rng.randrange(64) for _ in range(rng.randint(2, 7))]
            traj.extend_action(ids, [0.0] * len(ids), [0] * len(ids))
            out.append(with_true_logprobs(traj, model))
    return out


def moe_rollouts(engine_model):
    """Four groups of four 24-token samples of the real `TorchEngine` on `engine_model`, routing recorded."""
    from molt.agents.runner import record_completion
    from molt.engine import SamplingParams, TorchEngine

    engine = TorchEngine(engine_model.eval(), num_slots=16, max_seq_len=64, eos_token_ids=(), seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (8,), generator=gen).tolist() for _ in range(4)]

    async def run():
        groups = await asyncio.gather(*(engine.generate_group(p, SamplingParams(n=4, max_tokens=24)) for p in prompts))
        await engine.close()
        return groups

    trajs = []
    for g, (prompt, group) in enumerate(zip(prompts, asyncio.run(run()), strict=True)):
        for c in group:
            traj = Trajectory(group_id=g, rollout_id=len(trajs), reward=float(c.sample_index % 2))
            traj.extend_prompt(prompt)
            record_completion(traj, c, keep_ids=False)
            trajs.append(traj)
    return trajs


def trajectories(model, num_groups=3, n=4, temperature=1.0, version=0, seed=0, same_prompt=False):
    """Complete groups of random one- or two-turn trajectories (tokens of `version`, observations between turns),
    with their true rollout log-probs at `temperature`; `same_prompt`: each group shares one prompt."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        prompt_rng = random.Random(seed * 1000 + g)
        prompt = [prompt_rng.randrange(64) for _ in range(prompt_rng.randint(5, 12))]
        for k in range(n):
            traj = Trajectory(group_id=g, rollout_id=g * n + k, reward=float(rng.random() < 0.5))
            traj.extend_prompt(prompt if same_prompt else [rng.randrange(64) for _ in range(rng.randint(3, 9))])
            for _turn in range(rng.randint(1, 2)):
                ids = [rng.randrange(64) for _ in range(rng.randint(2, 7))]
                traj.extend_action(ids, [0.0] * len(ids), [version] * len(ids), keep_copy=True)
                traj.extend_prompt([rng.randrange(64) for _ in range(2)])
            out.append(with_true_logprobs(traj, model, temperature))
    return out


def trainer_cfg(*flags: str):
    """The trainer tests' config: 64-token rows, no LR warm-up, then `flags`."""
    from molt.cli.main import parse_config

    return parse_config(["--data.max_len", "64", "--rollout.max_len", "64", "--train.warmup_steps", "0", *flags])


@dataclass
class Ran:
    """What a `molt` command left behind: its exit code and stderr."""

    returncode: int
    stderr: str


def run_molt(capsys, *args: str) -> Ran:
    """`molt ARGS` in this process, through the CLI's entry point (`molt.cli.main.main`)."""
    from molt.cli.main import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    return Ran(code, capsys.readouterr().err)


def one_line(result, *needles: str) -> str:
    """The single stderr line of a user error (exit code 2, no traceback), containing every needle."""
    err = result.stderr.strip()
    assert result.returncode == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


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


def packed_trainer_logprobs(model, prompts_, completions, temperature) -> list[torch.Tensor]:
    """The trainer's own scoring of each prompt + completion: its packing and `token_logprobs` (fp32 from the
    logits, whatever the model's dtype), cut back to each completion's tokens."""
    from molt.train.packing import pack, placements
    from molt.train.trainer import token_logprobs

    samples = [list(p) + c.token_ids for p, c in zip(prompts_, completions, strict=True)]
    masks = [[0] * len(p) + [1] * len(c.token_ids) for p, c in zip(prompts_, completions, strict=True)]
    out: list[torch.Tensor | None] = [None] * len(samples)
    with torch.no_grad():
        for batch in pack(samples, masks, max(map(len, samples)), 4096):
            logp_rw = token_logprobs(model, batch.to(next(model.parameters()).device), temperature or 1.0).cpu()
            for row, col, piece in placements(batch.rows):
                first = col + len(prompts_[piece.sample]) - 1
                out[piece.sample] = logp_rw[row, first : col + len(piece) - 1]
    return out
