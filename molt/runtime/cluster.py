"""Ray cluster and placement: join or start a cluster, reserve one bundle per actor, surface failures.

A local cluster (no `runtime.address`) advertises enough logical CPUs for every actor, so a small
machine oversubscribes its cores rather than hanging on a placement group it can never fill.
Knows Ray and the `runtime` config group; nothing of models, engines or trainers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from molt.config import ConfigError, RuntimeConfig
from molt.errors import RunFatalError


class ActorFailedError(RunFatalError, RuntimeError):
    """A Ray actor raised or died; the message carries the actor's name and its traceback (the run stops)."""


def connect(rt: RuntimeConfig) -> bool:
    """Join `rt.address`, or the cluster this process already joined, or start a local one; True when this call
    started the connection (so the runtime's `shutdown` ends it)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    if rt.address and rt.address != "auto":  # ray.init would retry an unreachable address for minutes
        host, _, port = rt.address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            message = f"runtime.address: cannot reach {rt.address} ({e}); is `ray start --head` running there?"
            raise ConfigError(message) from None
    num_cpus = rt.num_cpus or int((rt.engines + rt.trainer_ranks) * max(rt.cpus_per_actor, 1) + 1)
    local = {} if rt.address else {"num_cpus": num_cpus, "include_dashboard": False}
    on_term = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=rt.address or "local", runtime_env=env, log_to_driver=True, **local)
    except ConnectionError as e:  # `auto` with no cluster running (RAY_ADDRESS unset, none on this machine)
        raise ConfigError(f"runtime.address: {rt.address}: {e} Start one with `ray start --head`, or leave "
                          "runtime.address empty for a local one") from None  # fmt: skip
    if threading.current_thread() is threading.main_thread():  # Ray's core installs its own crash-dump handler
        signal.signal(signal.SIGTERM, on_term)  # the host program's (molt: a clean stop) or the default
    return True


class Placement:
    """One placement group with a bundle per actor (engines first, then trainer ranks)."""

    def __init__(self, rt: RuntimeConfig, num_actors: int, local: bool = False):
        """`local`: the cluster this run started, which cannot grow: a request over its resources fails at once
        (a remote cluster may autoscale: up to 120 s, one second at a time so that Ctrl-C and SIGTERM act)."""
        bundle = {"CPU": rt.cpus_per_actor} | ({"GPU": rt.gpus_per_actor} if rt.gpus_per_actor else {})
        have = ray.cluster_resources()
        cannot = f"runtime: the cluster cannot place {num_actors} actors of {bundle} (resources: {have}); lower " \
                 "runtime.engines/trainer_ranks or *_per_actor"  # fmt: skip
        if local and any(have.get(k, 0) < v * num_actors for k, v in bundle.items()):
            raise ActorFailedError(cannot)
        self.group = placement_group([dict(bundle) for _ in range(num_actors)], strategy="PACK")
        self.resources = dict(num_cpus=rt.cpus_per_actor, num_gpus=rt.gpus_per_actor)
        if not any(self.group.wait(timeout_seconds=1) for _ in range(120)):
            remove_placement_group(self.group)
            raise ActorFailedError(cannot)

    def options(self, index: int, name: str, **kw: Any) -> dict[str, Any]:
        """Ray actor options pinning an actor to bundle `index`."""
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return dict(self.resources, scheduling_strategy=strategy, name=name, **kw)

    def remove(self) -> None:
        remove_placement_group(self.group)


def get(refs, what: str):
    """`ray.get` whose failures name what failed and include the actor's traceback; of several refs, one whose actor
    died is named first (ray.get raises the first failure in list order: a peer's broken-connection error)."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as e:
        died = next(filter(None, map(_death, refs if isinstance(refs, list) else [])), None)
        cause = f" an actor died (its peers' errors follow from it):\n{died}" if died else f"\n{e}"
        raise ActorFailedError(f"{what} failed:{cause}") from e


def _death(ref) -> str | None:
    """The error of `ref`'s actor if it died (the ref done), else None."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - not done, or another failure: not a death
        return None
    return None


def kill(actors: Sequence[Any]) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor, no_restart=True)
