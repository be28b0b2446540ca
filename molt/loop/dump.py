"""Rollout dumps: every trained batch as one jsonl shard per step, and reading a shard back with its checks.

`--rollout.dump` writes `<run_dir>/rollouts/step-<N>.jsonl` atomically before step N trains: one line per trajectory, in
the trainer's order, with the `Trajectory` fields plus `step` and `version` (the trainer's). Images keep their start and
hash; their pixels go once to `rollouts/images/<hash>.pt`. `info` is written as JSON whatever it holds (`json_safe`:
arrays as lists, non-finite floats as text, other keys as str, other values as their repr), never failing. Floats keep
`repr` precision, so a read-back batch is bit-identical. `read_shard` checks every line (types, aligned lists,
vocabulary, action hashes, pixels, versions, MoE routing: shape, expert ids) and fails with a `DumpError` naming file,
line and field. Knows trajectories only."""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from molt.data.trajectory import Trajectory
from molt.errors import UserError
from molt.log import atomic_write, atomic_write_text, json_safe
from molt.models.config import TransformerConfig
from molt.models.vision import ImageError, pixel_hash
from molt.train.batch import ImageMismatchError, trajectory_pixels

ROLLOUTS = "rollouts"  # in the run directory
IMAGES = "images"  # in the rollouts folder: content-addressed pixel tensors
REQUIRED = ("step", "version", "tokens", "loss_mask", "rollout_logprobs", "versions", "reward", "group_id",
            "rollout_id", "actions")  # fmt: skip
OPTIONAL = {f.name for f in fields(Trajectory)} - set(REQUIRED) | {"routing_dtype"}


class DumpError(UserError):
    """A rollout dump that cannot be replayed: the message names the file, line and field."""

    kind = "rollout dump"


def shard_name(step: int) -> str:
    return f"step-{step:06d}.jsonl"


def trajectory_record(traj: Trajectory, step: int, version: int, images: Path) -> dict[str, Any]:
    """`traj` as one JSON-ready line of step `step`'s shard; its images' pixels are saved under `images`."""
    record = {"step": step, "version": version} | {f.name: getattr(traj, f.name) for f in fields(Trajectory)}
    record["actions"], record["info"] = [list(a) for a in traj.actions], json_safe(traj.info)
    if traj.routing is not None:
        record["routing"], record["routing_dtype"] = traj.routing.tolist(), str(traj.routing.dtype)
    if traj.images:
        record["images"] = [_save_image(im, images) for im in traj.images]
    return record


def _save_image(image: dict[str, Any], folder: Path) -> dict[str, Any]:
    """An image record without its pixels, which are written once to `folder/<hash>.pt`."""
    path = folder / f"{image['hash']}.pt"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(image["pixels"], tmp))
    return {k: v for k, v in image.items() if k != "pixels"}


def write_shard(folder: Path, step: int, version: int, batch: list[Trajectory]) -> Path:
    """Write step `step`'s batch (trained at trainer `version`) to `folder/step-<step>.jsonl`, atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(trajectory_record(t, step, version, folder / IMAGES), default=json_safe) for t in batch]
    return atomic_write_text(folder / shard_name(step), "".join(line + "\n" for line in lines))


def rollouts_folder(path: str | os.PathLike) -> Path:
    """The folder of shards `path` names: a run directory (its `rollouts/`) or the rollouts folder itself."""
    path = Path(path)
    return path / ROLLOUTS if (path / ROLLOUTS).is_dir() else path


def shard_steps(folder: Path) -> list[int]:
    """The steps that have a shard in `folder`, ascending."""
    digits = (path.stem.removeprefix("step-") for path in folder.glob("step-*.jsonl"))
    return sorted(int(d) for d in digits if d.isdigit())


def drop_shards_after(folder: Path, step: int) -> None:
    """Remove the shards of the steps after `step`: a resumed run trains them again (an interrupted tail would mix
    with its new batches), as metrics.jsonl drops their rows."""
    for later in (s for s in shard_steps(folder) if s > step):
        (folder / shard_name(later)).unlink()


def read_shard(
    path: Path,
    *,
    step: int,
    vocab_size: int,
    trainer_version: int,
    max_staleness: int,
    moe: tuple | None = None,
    model_cfg: TransformerConfig | None = None,
) -> list[Trajectory]:
    """Step `step`'s batch from its shard, every line checked (see the module docstring); DumpError if wrong.
    `moe`: the policy's (MoE layers, top-k, experts), which recorded routing must fit (None: not checked; (): a
    dense policy, which takes no recorded routing). `model_cfg`: the policy's, whose image placeholders the recorded
    images must start at (the trainer's own check, here with the line)."""
    if not path.exists():
        raise DumpError(f"{path}: missing: the dump has no shard for step {step}")
    batch = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DumpError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            traj = _trajectory(record, where, path.parent / IMAGES, moe)
            _check_tokens(traj, where, vocab_size)
            if model_cfg is not None:
                _check_images(traj, where, model_cfg)
            _check_versions(record, traj, where, step, trainer_version, max_staleness)
            batch.append(traj)
    if not batch:
        raise DumpError(f"{path}: empty: step {step} trained on no trajectories")
    return batch


def _check_images(traj: Trajectory, where: str, model_cfg: TransformerConfig) -> None:
    """The recorded images start where the policy's placeholder runs do (and a text policy takes none)."""
    try:
        trajectory_pixels([traj], model_cfg)
    except (ImageMismatchError, ImageError) as e:
        raise _fail(where, "images", str(e)) from None


def _fail(where: str, key: str, what: str) -> DumpError:
    return DumpError(f"{where}: field {key!r}: {what}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, float | int) and not isinstance(x, bool)


def _check_types(record: Any, where: str) -> None:
    """Every required field present, no unknown one, and each per-token list of the right element type."""
    if not isinstance(record, dict):
        raise DumpError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
    if missing := [key for key in REQUIRED if key not in record]:
        raise _fail(where, missing[0], "missing")
    if unknown := sorted(set(record) - set(REQUIRED) - OPTIONAL):
        raise _fail(where, unknown[0], "unknown (not a Trajectory field)")
    for key, ok, kind in [("tokens", _is_int, "int"), ("loss_mask", lambda m: m in (0, 1), "0 or 1"),
                          ("versions", _is_int, "int"), ("rollout_logprobs", _is_number, "number")]:  # fmt: skip
        values = record[key]
        bad = 0 if not isinstance(values, list) else next((i for i, x in enumerate(values) if not ok(x)), None)
        if bad is not None:
            raise _fail(where, key, f"must be a list of {kind}" + (f" (entry {bad})" if values else ""))
    for key in ("step", "version", "group_id", "rollout_id"):
        if not _is_int(record[key]):
            raise _fail(where, key, f"must be an int, got {record[key]!r}")
    for key in ("reward", "score"):  # a live run's nonfinite filter never lets NaN / inf reach a dump
        value = record.get(key)
        if not (_is_number(value) and math.isfinite(value)) and (key == "reward" or value is not None):
            raise _fail(where, key, f"must be a finite number, got {value!r}")


def _trajectory(record: Any, where: str, images: Path, moe: tuple | None) -> Trajectory:
    """The Trajectory a checked line holds (routing back to a tensor, images with their pixels)."""
    _check_types(record, where)
    data = {k: v for k, v in record.items() if k not in ("step", "version", "routing_dtype")}
    try:
        data["actions"] = [(int(s), int(e), int(h), ids) for s, e, h, ids in record["actions"]]
    except (TypeError, ValueError):
        raise _fail(where, "actions", "must be a list of [start, end, hash, ids or null]") from None
    if record.get("routing") is not None:
        dtype = getattr(torch, str(record.get("routing_dtype", "torch.int64")).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise _fail(where, "routing_dtype", f"unknown dtype {record.get('routing_dtype')!r}")
        try:
            data["routing"] = torch.tensor(record["routing"], dtype=dtype)
        except (TypeError, ValueError) as e:
            raise _fail(where, "routing", f"not a [positions, layers, k] list of ints ({e})") from None
        if moe == ():  # the reader's policy is dense (None: not checked)
            raise _fail(where, "routing", "recorded, but the policy has no mixture-of-experts layers")
        _check_routing(data["routing"], where, len(record["tokens"]), moe)
    if record.get("images"):
        data["images"] = [_load_image(im, where, images) for im in record["images"]]
    traj = Trajectory(**data)
    try:
        traj.check()
    except ValueError as e:
        raise DumpError(f"{where}: {e}") from None
    return traj


def _load_image(image: Any, where: str, folder: Path) -> dict[str, Any]:
    """An image record with its pixels read back from `folder/<hash>.pt` and checked against the hash."""
    if not isinstance(image, dict) or not isinstance(image.get("hash"), str) or not _is_int(image.get("start")):
        raise _fail(where, "images", "each image must be {start: int, hash: str}")
    path = folder / f"{image['hash']}.pt"
    if not path.exists():
        raise _fail(where, "images", f"pixels {path} are missing")
    try:
        pixels = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the dump's fault, named as such
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _fail(where, "images", f"pixels {path} cannot be read ({type(e).__name__}: {first})") from None
    if not isinstance(pixels, torch.Tensor) or pixel_hash(pixels) != image["hash"]:
        raise _fail(where, "images", f"pixels {path} do not hash to {image['hash']}")
    return image | {"pixels": pixels}


def _check_routing(routing: torch.Tensor, where: str, num_tokens: int, moe: tuple | None) -> None:
    """Recorded expert ids: [<= num_tokens, MoE layers, top-k] ints; per position and layer either all -1 (no
    record) or k distinct ids in 0..experts-1."""
    layers, k, experts = moe or (None, None, None)
    if routing.dtype.is_floating_point or routing.dtype == torch.bool or routing.ndim != 3:
        raise _fail(where, "routing", f"must be a [positions, layers, k] list of ints, got {routing.dtype} "
                    f"of shape {tuple(routing.shape)}")  # fmt: skip
    n, num_layers, top_k = routing.shape
    if n > num_tokens or (moe and (num_layers, top_k) != (layers, k)):
        model = f", {layers} MoE layers, top-k {k}" if moe else ""
        raise _fail(where, "routing", f"shape {tuple(routing.shape)} does not fit [<= {num_tokens} tokens{model}]")
    low, high = (int(routing.min()), int(routing.max())) if routing.numel() else (-1, -1)
    if low < -1 or (experts is not None and high >= experts):
        bad = low if low < -1 else high
        raise _fail(where, "routing", f"expert id {bad} outside -1..{experts - 1 if experts else 'num_experts-1'}")
    none = routing < 0
    ids = routing.sort(-1).values
    mixed, repeated = none.any(-1) != none.all(-1), ((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any(-1)
    for what, bad in (("mixes -1 with expert ids", mixed), ("repeats an expert", repeated)):
        if bad.any():
            pos, layer = (int(x) for x in bad.nonzero()[0])
            raise _fail(where, "routing", f"position {pos} MoE layer {layer} {what}: {routing[pos, layer].tolist()}")


def _check_tokens(traj: Trajectory, where: str, vocab_size: int) -> None:
    """Ids inside the policy's vocabulary; mask 1 exactly on the recorded actions, whose ids hash as recorded."""
    bad = next((i for i, t in enumerate(traj.tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        vocab = f"the vocabulary (0..{vocab_size - 1})"
        raise _fail(where, "tokens", f"id {traj.tokens[bad]} at position {bad} is outside {vocab}")
    covered = 0
    for start, end, digest, _ in traj.actions:
        if not 0 <= start <= end <= len(traj.tokens) or hash(tuple(traj.tokens[start:end])) != digest:
            raise _fail(where, "tokens", f"tokens {start}:{end} differ from the engine's (their hash does not match)")
        if not all(traj.loss_mask[start:end]):
            raise _fail(where, "loss_mask", f"engine tokens {start}:{end} have mask 0")
        covered += end - start
    if covered != traj.num_action_tokens:
        raise _fail(where, "loss_mask", f"{traj.num_action_tokens - covered} mask-1 tokens were not generated")
    if any(not math.isfinite(x) for x, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m):
        raise _fail(where, "rollout_logprobs", "a sampled token's log-prob is not finite")


def _check_versions(record: dict, traj: Trajectory, where: str, step: int, trainer: int, max_staleness: int) -> None:
    """The line belongs to `step`, was trained at the replaying trainer's version, and no token is newer than
    that version or older than `max_staleness` versions."""
    if record["step"] != step:
        raise _fail(where, "step", f"{record['step']} in the shard of step {step}")
    if record["version"] != trainer:
        replaying = f"the replaying trainer is at version {trainer}"
        raise _fail(where, "version", f"step {step} trained at version {record['version']}, {replaying}")
    sampled = [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m]
    if any(v < 0 for v in sampled):
        raise _fail(where, "versions", f"a sampled token has version {min(sampled)} (< 0)")
    if sampled and max(sampled) > trainer:
        newer = f"is newer than the trainer (version {trainer} at step {step})"
        raise _fail(where, "versions", f"a token sampled at version {max(sampled)} {newer}")
    if sampled and trainer - min(sampled) > max_staleness:
        allowed = f"rollout.max_staleness={max_staleness} allows at version {trainer}"
        raise _fail(where, "versions", f"a token sampled at version {min(sampled)} is older than {allowed}")
