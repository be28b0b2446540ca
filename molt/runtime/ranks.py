"""Data-parallel trainer ranks as Ray actors, and `RayTrainer`, the driver's one trainer (the `Trainer` protocol).

Each `TrainerRank` joins a torch.distributed group (gloo on CPU; on CUDA NCCL, with gloo for CPU tensors), builds
the ordinary `Trainer` with every model wrapped with FSDP2 (LoRA adapters stay whole) and steps on its shard of the
batch (whole groups, balanced by tokens); denominators and metric sums are all-reduced, so the step equals
single-process training. The sharded checkpoint holds every model and optimizer, so a run resumes on any number of
ranks. Knows Ray, the trainer and torch.distributed.checkpoint; nothing of engines or the loop."""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import ray
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from ray import cloudpickle

from molt import algo
from molt.config import Config
from molt.data.trajectory import Trajectory
from molt.runtime.cluster import ActorFailedError, get
from molt.runtime.engines import ChunkedWeights, chunk_weights
from molt.train import parallel


class TrainerRank:
    """One rank: a `Trainer` whose models are FSDP2-sharded (wrapped with `ray.remote` by `RayTrainer`)."""

    def __init__(self, cfg: Config, model, rank: int, world_size: int, own_variants: list | tuple = ()):
        algo.register_own(own_variants)  # the driver's own estimators, losses, ... (registered before molt.train)
        torch.set_num_threads(cfg.runtime.threads or 1)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model = model.to(cfg.runtime.device)

    @ray.method(concurrency_group="ping")
    def ping(self) -> int:
        """Answered beside a running call (its own thread): a rank that cannot answer is stopped or hung."""
        return os.getpid()

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, address: str, port: int) -> None:
        from molt.train.trainer import Trainer

        rt = self.cfg.runtime
        parallel.init_process_group(self.rank, self.world_size, address, port, rt.device, rt.collective_timeout_s)
        torch.manual_seed(self.cfg.train.seed)  # the replicated LoRA adapters start equal on every rank
        self.trainer = Trainer(self.model, self.cfg, fsdp=True)

    def step(self, trajs: list[Trajectory], shard: list[int]) -> dict[str, float]:
        return self.trainer.step(trajs, shard)

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full CPU tensor) of the policy, with LoRA its merged weights; a collective: every rank iterates."""
        lora = self.trainer.lora
        for name, value in parallel.full_tensors(self.model):
            yield name, value if lora is None else lora.merge(name, value)

    def weights(self, chunk_bytes: int) -> ChunkedWeights | None:
        """Gather full tensors (a collective); rank 0 puts them in the object store in chunks (not the frozen
        routers of `train.freeze_router`: the engines hold them already)."""
        items = ((name, value) for name, value in self.full_weights() if name not in self.trainer.frozen)
        if self.rank == 0:
            return chunk_weights(items, chunk_bytes)
        for _ in items:  # take part in every gather
            pass
        return None

    def save(self, folder: str, tokenizer) -> dict:
        """Every model and optimizer as shards under `folder/dcp` (all ranks); from rank 0 the HF policy folder
        (merged with LoRA, the PEFT adapter in `adapter/`). Returns the unsharded state: schedules, KL coefficient."""
        full, t = dict(self.full_weights()), self.trainer
        if self.rank == 0:
            _export(self.model.cfg, full, folder, tokenizer)
            if t.lora is not None:
                t.lora.save_peft(Path(folder) / "adapter", self.cfg.model.path)
        torch.distributed.barrier()
        dcp.save(self._state_dicts(), checkpoint_id=str(Path(folder) / "dcp"))
        critic = t.critic.schedule.state_dict() if t.critic is not None else None
        state = {"schedule": t.schedule.state_dict(), "kl_coef": t.kl_control.coef, "critic_schedule": critic}
        return state | {"scalers": t.scaler_states()}

    def load(self, folder: str, state: dict) -> None:
        """Load a sharded checkpoint written by any number of ranks (DCP reshards on load)."""
        sd = self._state_dicts()
        dcp.load(sd, checkpoint_id=str(Path(folder) / "dcp"))
        strict = dsd.StateDictOptions(strict=True)
        for key, module, opt, opt_key in self._parts():
            if opt is None:
                dsd.set_model_state_dict(module, sd[key], options=strict)
            else:
                dsd.set_state_dict(module, opt, model_state_dict=sd[key], optim_state_dict=sd[opt_key], options=strict)
        trainer = self.trainer
        trainer.schedule.load_state_dict(state["schedule"])
        if trainer.critic is not None:
            trainer.critic.schedule.load_state_dict(state["critic_schedule"])
        trainer.load_extra_state(state)  # last: it applies this config's settings (critic, LoRA: in the shards)
        trainer.version, trainer.num_skipped_steps = state["version"], state.get("num_skipped_steps", 0)

    def _parts(self) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer | None, str]]:
        """(key, module, the optimizer of its parameters or None, that optimizer's key) of each module in the
        sharded checkpoint. With LoRA the policy's optimizer steps the adapters; the model holds the base weights."""
        t = self.trainer
        parts = [("model", t.model, t.opt if t.lora is None else None, "optim")]
        if t.lora is not None:
            parts.append(("lora", t.lora, t.opt, "optim"))
        if t.critic is not None:
            parts.append(("critic", t.critic.model, t.critic.opt, "critic_optim"))
        if t.ref is not None:  # the initial policy: a resumed rank starts from the checkpoint's policy
            parts.append(("ref", t.ref, None, ""))
        return parts

    def _state_dicts(self) -> dict:
        """The DCP state: each part's (sharded) weights, and each optimizer's state under its key."""
        out = {}
        for key, module, opt, opt_key in self._parts():
            if opt is None:
                out[key] = dsd.get_model_state_dict(module)
            else:
                out[key], out[opt_key] = dsd.get_state_dict(module, opt)
        return out


def _export(cfg, full: dict[str, torch.Tensor], folder: str, tokenizer) -> None:
    """The HF policy folder from gathered full weights (a plain CPU model of the policy's config)."""
    from molt.models.hf_io import empty_model, save_pretrained

    export = empty_model(cfg, next(iter(full.values())).dtype)
    export.load_state_dict(full)
    save_pretrained(export, folder, tokenizer)


def _your_module(module) -> bool:
    """Whether `module` is your own code (a file outside Molt, the standard library and installed packages), which a
    rank's process may not import: its functions are sent by value (cloudpickle sends `__main__`'s so anyway)."""
    file, elsewhere = getattr(module, "__file__", None), [sysconfig.get_paths()[k] for k in ("stdlib", "purelib")]
    outside = file and not os.path.realpath(file).startswith(tuple(os.path.realpath(p) for p in elsewhere))
    return bool(outside) and module.__name__.split(".")[0] not in ("molt", "__main__")


def spawn_rank(cfg: Config, model_ref, rank: int, world_size: int, options: dict):
    """A `TrainerRank` actor (not yet in its process group: `RayTrainer` sets the group up), given the variants the
    driver registered from your own code, sent by value (the actor's process need not import their module)."""
    variants = algo.own_variants()
    for module in {sys.modules.get(getattr(v, "__module__", None) or "") for _, _, v, _ in variants} - {None}:
        if _your_module(module):
            cloudpickle.register_pickle_by_value(module)
    actor = ray.remote(concurrency_groups={"ping": 1})(TrainerRank)  # `ping` answers beside a running call
    return actor.options(**options).remote(cfg, model_ref, rank, world_size, variants)


class RayTrainer:
    """The loop's trainer, fanned out over `trainer_ranks` actors."""

    def __init__(self, cfg: Config, ranks: list):
        self.cfg, self.ranks, self.version, self.num_skipped_steps = cfg, ranks, 0, 0
        self.last_weights: ChunkedWeights | None = None
        address, port = get(ranks[0].address.remote(), "trainer rank 0")
        self._get([r.setup.remote(address, port) for r in ranks], "trainer setup")

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        shards = parallel.split_by_tokens(trajs, len(self.ranks))
        if not all(shards):
            raise ValueError(f"a step needs >= {len(self.ranks)} groups, one per trainer rank")
        batch = ray.put(trajs)
        results = self._get([r.step.remote(batch, s) for r, s in zip(self.ranks, shards, strict=True)], "trainer step")
        self.version += 1
        self.num_skipped_steps = int(results[0]["train/skipped_steps"])
        tokens = [sum(len(trajs[i].tokens) for i in s) for s in shards]
        return results[0] | {f"train/rank{r}_tokens": n for r, n in enumerate(tokens)}

    def weights(self) -> ChunkedWeights:
        """Full weights in the object store (gathered from the shards), for every engine to fetch."""
        chunk = self.cfg.runtime.sync_chunk_mb << 20
        self.last_weights = self._get([r.weights.remote(chunk) for r in self.ranks], "weight gather")[0]
        return self.last_weights

    sharded = True  # model and optimizer as torch.distributed.checkpoint shards

    def save(self, folder: Path, tokenizer) -> dict:
        states = self._get([r.save.remote(str(folder), tokenizer) for r in self.ranks], "checkpoint save")
        return {"sharded": True, "num_ranks": len(self.ranks), **states[0]}

    def _get(self, refs: list, what: str):
        """`get`, pinging every rank while it waits: one that leaves a ping unanswered for
        `runtime.collective_timeout_s` (stopped, or stuck holding the GIL) stops the run naming it, instead of a
        wait for ever (a collective times out only where two ranks meet)."""
        timeout = self.cfg.runtime.collective_timeout_s
        while len(ray.wait(refs, num_returns=len(refs), timeout=timeout / 4)[0]) < len(refs):
            pings = [r.ping.remote() for r in self.ranks]
            answered = ray.wait(pings, num_returns=len(pings), timeout=timeout)[0]
            if hung := [i for i, p in enumerate(pings) if p not in answered]:
                rank = f"trainer rank {hung[0]} (molt-rank-{hung[0]})"
                raise ActorFailedError(f"{what} failed: {rank} left a ping unanswered for {timeout} s "
                                       "(runtime.collective_timeout_s): stopped or hung")  # fmt: skip
        return get(refs, what)

    def load(self, folder: Path, state: dict) -> None:
        self._get([r.load.remote(str(folder), state) for r in self.ranks], "checkpoint load")
        self.version = state["version"]
