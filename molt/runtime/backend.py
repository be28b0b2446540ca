"""`--runtime.backend ray`: engine replicas and trainer ranks as actors in one placement group.

`RayRuntime` gives the loop one `Engine` (a `Router` over `RemoteEngine` replicas) and one trainer (`RayTrainer`),
plus per-step metrics (load per replica, restarts, weight-sync GB/s). Agents and the chat server stay in the
driver's asyncio loop. `shutdown()` kills every actor and frees the placement group, on exit, error or Ctrl-C."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from molt.config import Config
from molt.engine.interface import work_since
from molt.engine.router import Router
from molt.runtime import cluster
from molt.runtime.base import Runtime
from molt.runtime.engines import RemoteEngine
from molt.runtime.ranks import RayTrainer, spawn_rank


class RayRuntime(Runtime):
    """Builds the trainer ranks first (a resume loads their shards), then the engine replicas."""

    def __init__(self, cfg: Config, model):
        rt = cfg.runtime
        self.cfg, self.started = cfg, cluster.connect(rt)
        self.placement: cluster.Placement | None = None
        self.engines: list[RemoteEngine] = []
        self.ranks: list = []
        self.watchers: list[asyncio.Future] = []  # one `RemoteEngine.watch` per replica
        self.router: Router | None = None
        self.engine_stats: dict[int, dict] = {}  # each replica's counters as of the previous step's metrics
        try:  # a failure here (placement, a rank) ends the connection this run started, as a finished run does
            engines = 0 if cfg.rollout.replay else rt.engines  # a replay trains on its dump: no engine
            self.placement = cluster.Placement(rt, engines + rt.trainer_ranks, local=self.started and not rt.address)
            self.model_ref = ray.put(model)
            options = [self.placement.options(engines + r, f"molt-rank-{r}") for r in range(rt.trainer_ranks)]
            self.ranks = [spawn_rank(cfg, self.model_ref, r, rt.trainer_ranks, o) for r, o in enumerate(options)]
            self.trainer = RayTrainer(cfg, self.ranks)
        except BaseException:
            self.shutdown()
            raise

    def start_engines(self, tokenizer, version: int) -> Router:
        """`runtime.engines` replicas holding the driver's model at `version`, behind one router."""
        cfg, rt = self.cfg, self.cfg.runtime
        args = (cfg, self.model_ref, tokenizer, version)
        for i in range(rt.engines):
            options = self.placement.options(i, f"molt-engine-{i}", max_restarts=rt.engine_restarts)
            self.engines.append(RemoteEngine.spawn(i, options, args, version, rt.sync_chunk_mb << 20))
        cluster.get([e.actor.ready.remote() for e in self.engines], "engine start")
        if rt.engine_timeout_s:  # a hung replica is restarted like a dead one
            self.watchers = [asyncio.ensure_future(e.watch(rt.engine_timeout_s)) for e in self.engines]
        self.router = Router(self.engines)
        return self.router

    def metrics(self) -> dict[str, Any]:
        """Per-replica load, work since the previous call (evals included) and the last weight sync, for a step."""
        out: dict[str, Any] = {}
        for e in self.engines:
            # resent: calls re-sent after the replica died
            counts = {"requests": e.num_requests, "restarts": e.num_restarts, "resent": e.num_resent}
            if e.stats:  # busy_s, decode_s, decode_batch_mean
                counts |= work_since(e.stats, self.engine_stats.get(e.index, {}))
                self.engine_stats[e.index] = e.stats
            out |= {f"engine/{e.index}/{key}": value for key, value in counts.items()}
        weights = self.trainer.last_weights
        if weights is not None and self.engines:
            push_s = max(e.sync_s for e in self.engines)
            out |= {
                "sync/gb": weights.num_bytes / 1e9,
                "sync/gather_s": weights.gather_s,
                "sync/push_s": push_s,
                "sync/gb_per_s": weights.num_bytes * len(self.engines) / 1e9 / max(push_s, 1e-9),
            }
        return out

    async def close(self) -> None:
        """Close the replicas, then kill every actor of the run."""
        for watcher in self.watchers:
            watcher.cancel()
        if self.router is not None:
            await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
        self.shutdown()

    def shutdown(self) -> None:
        """Kill this run's actors and placement group; end the Ray connection if this run started it."""
        cluster.kill([e.actor for e in self.engines] + self.ranks)
        if self.placement is not None:
            self.placement.remove()
        if self.started:
            ray.shutdown()
