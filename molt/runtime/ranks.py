"""Data-parallel trainer ranks as Ray actors, and `RayTrainer`, the driver's one trainer.

Each `TrainerRank` joins a torch.distributed group (gloo on CPU, NCCL on CUDA), wraps its model
with FSDP2 (`molt.train.parallel.parallelize`) and runs the ordinary `Trainer.step` on its shard
of the batch (whole groups, balanced by token count); denominators and metric sums are
all-reduced, so the step equals single-process training. `RayTrainer` has the surface the loop
and checkpoints use: `step(batch)`, `version`, `weights()`, `save`/`load` (the `Trainer` protocol).
Knows Ray, the trainer and torch.distributed.checkpoint; nothing of engines or the loop.
"""

from __future__ import annotations

import socket
from pathlib import Path

import ray
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from molt.config import Config
from molt.data.trajectory import Trajectory
from molt.runtime.cluster import get
from molt.runtime.engines import ChunkedWeights, chunk_weights
from molt.train import parallel


class TrainerRank:
    """One rank: a FSDP2-sharded model and its `Trainer` (wrapped with `ray.remote` by `RayTrainer`)."""

    def __init__(self, cfg: Config, model, rank: int, world_size: int):
        torch.set_num_threads(cfg.runtime.threads or 1)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model = model.to(cfg.runtime.device)

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, address: str, port: int) -> None:
        from molt.train.optim import build_optimizer
        from molt.train.trainer import Trainer

        rt = self.cfg.runtime
        parallel.init_process_group(self.rank, self.world_size, address, port, rt.device, rt.collective_timeout_s)
        self.trainer = Trainer(self.model, self.cfg)  # the reference copy (kl_coef > 0) stays unsharded
        precision = self.trainer.precision
        parallel.parallelize(self.model, precision.compute if precision.mixed else None)
        self.trainer.precision = precision.unsharded()  # FSDP2 casts the parameters: no autocast on top
        self.trainer.opt, self.trainer.schedule = build_optimizer(self.model.parameters(), self.cfg.train)

    def step(self, trajs: list[Trajectory], shard: list[int]) -> dict[str, float]:
        return self.trainer.step(trajs, shard)

    def weights(self, chunk_bytes: int) -> ChunkedWeights | None:
        """Gather full tensors (a collective); rank 0 puts them in the object store in chunks."""
        items = parallel.full_tensors(self.model)
        if self.rank == 0:
            return chunk_weights(items, chunk_bytes)
        for _ in items:  # take part in every gather
            pass
        return None

    def save(self, folder: str, tokenizer) -> dict:
        """Sharded model+optimizer under `folder/dcp` (all ranks); the HF policy folder from rank 0."""
        from molt.models import Transformer, save_pretrained

        full = dict(parallel.full_tensors(self.model))
        if self.rank == 0:
            cfg = self.model.cfg
            with torch.device("meta"):
                export = Transformer(cfg)
            export = export.to_empty(device="cpu").to(next(iter(full.values())).dtype)
            export.reset_rope()
            if cfg.tie_word_embeddings:
                export.lm_head.weight = export.embed_tokens.weight
            export.load_state_dict(full)
            save_pretrained(export, folder, tokenizer)
        torch.distributed.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.trainer.opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(folder) / "dcp"))
        return {"schedule": self.trainer.schedule.state_dict()}

    def load(self, folder: str, state: dict) -> None:
        """Load a sharded checkpoint written by any number of ranks (DCP reshards on load)."""
        model_sd, optim_sd = get_state_dict(self.model, self.trainer.opt)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=str(Path(folder) / "dcp"))
        set_state_dict(self.model, self.trainer.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(strict=True))  # fmt: skip
        self.trainer.schedule.load_state_dict(state["schedule"])
        self.trainer.version = state["version"]


def spawn_rank(cfg: Config, model_ref, rank: int, world_size: int, options: dict):
    """A `TrainerRank` actor (not yet in its process group: `RayTrainer` sets the group up)."""
    return ray.remote(TrainerRank).options(**options).remote(cfg, model_ref, rank, world_size)


class RayTrainer:
    """The loop's trainer, fanned out over `trainer_ranks` actors."""

    def __init__(self, cfg: Config, ranks: list, version: int = 0):
        self.cfg, self.ranks, self.version = cfg, ranks, version
        self.num_skipped_steps = 0
        address, port = get(ranks[0].address.remote(), "trainer rank 0")
        get([r.setup.remote(address, port) for r in ranks], "trainer setup")
        self.last_weights: ChunkedWeights | None = None

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        shards = parallel.split_by_tokens(trajs, len(self.ranks))
        if not all(shards):
            raise ValueError(f"a step needs >= {len(self.ranks)} groups, one per trainer rank")
        batch = ray.put(trajs)
        results = get([r.step.remote(batch, s) for r, s in zip(self.ranks, shards, strict=True)], "trainer step")
        self.version += 1
        self.num_skipped_steps = int(results[0]["train/skipped_steps"])
        tokens = [sum(len(trajs[i].tokens) for i in s) for s in shards]
        return results[0] | {f"train/rank{r}_tokens": n for r, n in enumerate(tokens)}

    def weights(self) -> ChunkedWeights:
        """Full weights in the object store (gathered from the shards), for every engine to fetch."""
        chunk = self.cfg.runtime.sync_chunk_mb << 20
        self.last_weights = get([r.weights.remote(chunk) for r in self.ranks], "weight gather")[0]
        return self.last_weights

    sharded = True  # model and optimizer as torch.distributed.checkpoint shards

    def save(self, folder: Path, tokenizer) -> dict:
        states = get([r.save.remote(str(folder), tokenizer) for r in self.ranks], "checkpoint save")
        return {"sharded": True, "num_ranks": len(self.ranks), **states[0]}

    def load(self, folder: Path, state: dict) -> None:
        if self.cfg.algo.kl_coef > 0:
            raise NotImplementedError("ckpt.resume with runtime.backend ray and algo.kl_coef > 0: the sharded "
                                      "checkpoint does not hold the reference model yet")  # fmt: skip
        get([r.load.remote(str(folder), state) for r in self.ranks], "checkpoint load")
        self.version = state["version"]
