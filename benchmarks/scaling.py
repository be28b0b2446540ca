"""Scale-out on Ray: rollout samples/s with 1 vs 2 engine replicas, and weight-sync GB/s vs a broadcast.

1. The default recipe (`molt train`, warm-started tiny model, calculator task) under
   `--runtime.backend ray` with 1 trainer rank and 1 or 2 engine replicas (one engine thread
   each); samples/s = trained samples / summed step wall time, first step (warm-up) excluded.
2. Weight sync of the `--preset` model to 2 engine replicas through Molt's path (chunks into the Ray
   object store, every replica fetches and loads them into its model, names checked) vs the
   ceiling: a plain `torch.distributed.broadcast` (gloo) of the same number of bytes from one
   process to the same number of receiver processes, measured in the same run. GB/s counts the
   bytes delivered to all replicas. Best of `--reps`.

Run: `.venv/bin/python benchmarks/scaling.py [--steps 8] [--preset small]`; writes
benchmarks/results/scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from molt.cli.main import parse_config
from molt.cli.train import run_train
from molt.engine.router import Router
from molt.models import Transformer, preset
from molt.models.tokenizer import build_builtin_tokenizer
from molt.runtime.engines import RemoteEngine, chunk_weights


def rollout_scaling(engines: int, steps: int, tmp: str) -> dict[str, float]:
    flags = ["--runtime.backend", "ray", "--runtime.engines", str(engines), "--train.max_steps", str(steps),
             "--train.warmup_steps", "0", "--eval.every", "0", "--log.every", "1000",
             "--log.run_dir", os.path.join(tmp, f"e{engines}")]  # fmt: skip
    history = run_train(parse_config(flags)).history[1:]
    seconds = sum(m["time/step_s"] for m in history)
    samples = sum(m["train/num_samples"] for m in history)
    load = [history[-1][f"engine/{i}/requests"] for i in range(engines)]
    return {"samples_per_s": samples / seconds, "seconds": seconds, "samples": samples, "requests": load}


class BroadcastPeer:
    """One process of the baseline gloo group (rank 0 sends)."""

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, rank: int, world: int, address: str, port: int) -> None:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world)

    def broadcast(self, num_bytes: int) -> float:
        buf = torch.ones(num_bytes // 4) if dist.get_rank() == 0 else torch.empty(num_bytes // 4)
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        dist.barrier()
        return time.perf_counter() - t0


def weight_sync(preset_name: str, num_engines: int, reps: int) -> dict[str, float]:
    tokenizer = build_builtin_tokenizer()
    model = Transformer(preset(preset_name, vocab_size=len(tokenizer))).init_weights(0.02, torch.Generator())
    num_bytes = sum(v.nbytes for v in model.state_dict().values())
    args = (ray.put(model), None, {"num_slots": 4, "max_seq_len": 64}, 1, "cpu")
    engines = [RemoteEngine.spawn(i, {"num_cpus": 1}, args, 0, 64 << 20) for i in range(num_engines)]
    router = Router(engines)
    ray.get([e.actor.ready.remote() for e in engines])

    async def sync(version: int) -> float:
        t0 = time.perf_counter()
        await router.update_weights(chunk_weights(model.state_dict(), 64 << 20), version)
        return time.perf_counter() - t0

    ours = min(asyncio.run(sync(v)) for v in range(1, reps + 1))
    for e in engines:
        ray.kill(e.actor)
    peers = [ray.remote(BroadcastPeer).options(num_cpus=1).remote() for _ in range(num_engines + 1)]
    address, port = ray.get(peers[0].address.remote())
    ray.get([p.setup.remote(r, len(peers), address, port) for r, p in enumerate(peers)])
    ceiling = min(min(ray.get([p.broadcast.remote(num_bytes) for p in peers])) for _ in range(reps))
    for p in peers:
        ray.kill(p)
    delivered = num_bytes * num_engines / 1e9
    return {"gb": num_bytes / 1e9, "ours_s": ours, "ours_gbps": delivered / ours, "bcast_s": ceiling,
            "bcast_gbps": delivered / ceiling}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sync-only", action="store_true", help="measure only the weight sync (prints, no file)")
    args = parser.parse_args()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False, runtime_env=env)
    load_before = os.getloadavg()[0]
    if args.sync_only:
        print(weight_sync(args.preset, 2, args.reps), f"load {load_before:.1f}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        one, two = (rollout_scaling(n, args.steps, tmp) for n in (1, 2))
    sync = weight_sync(args.preset, 2, args.reps)
    ray.shutdown()
    table = ["| engine replicas | samples | RL seconds | samples/s | requests per replica |", "|---|---|---|---|---|"]
    table += [f"| {n} | {r['samples']} | {r['seconds']:.1f} | {r['samples_per_s']:.1f} | {r['requests']} |"
              for n, r in ((1, one), (2, two))]  # fmt: skip
    text = (
        f"# Scale-out on Ray (default recipe, {args.steps} steps, 1 trainer rank; {os.cpu_count()} cores, "
        f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}, machine shared with other jobs)\n\n"
        + "\n".join(table)
        + f"\n\nrollout scaling 2 / 1 replicas: **{two['samples_per_s'] / one['samples_per_s']:.2f}x**\n\n"
        f"## Weight sync ({args.preset} preset, {sync['gb']:.3f} GB, to 2 replicas, best of {args.reps})\n\n"
        "| path | seconds | delivered GB/s |\n|---|---|---|\n"
        f"| Molt: object-store chunks, fetched + loaded by each replica | {sync['ours_s']:.3f} | "
        f"{sync['ours_gbps']:.2f} |\n"
        f"| ceiling: torch.distributed.broadcast (gloo), same bytes, 1 -> 2 processes | {sync['bcast_s']:.3f} | "
        f"{sync['bcast_gbps']:.2f} |\n\n"
        f"Molt / broadcast: **{sync['ours_gbps'] / sync['bcast_gbps']:.2f}x** (goal >= 0.8x)\n"
    )
    print(text)
    (Path(__file__).parent / "results" / "scaling.md").write_text(text)


if __name__ == "__main__":
    main()
