"""Checkpoints: an HF policy folder plus the trainer and loop state beside it, written atomically (`molt train`'s, and
`molt sft`'s, whose `SftTrainer` saves its state the same way).

Layout: `<run>/checkpoints/step-<N>/` (HF files and trainer_state.pt) and `<run>/checkpoints/latest` naming the
newest complete one, written last, once the folder is flushed to disk: a crash mid-save (of the process or the
machine) resumes from the previous one, and its leftovers (`.step-N.*`, a `step-N/` without its trainer state) go at
the next save. `ckpt.keep` > 0 keeps the newest that many and deletes older
ones after each save. Files get the modes the user's umask gives new files, not the temp folder's 0700."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import pickle
import random
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from molt.config import ConfigError, check
from molt.config.run import latest_checkpoint
from molt.log import atomic_write, atomic_write_text, sync_tree
from molt.loop.rl import LoopState
from molt.models.hf_io import share_like_new_files
from molt.train.interface import Trainer


def remove_orphans(checkpoints: Path) -> list[Path]:
    """Remove what an interrupted save left in `checkpoints/` (hidden temp folders and files, a step folder past
    `latest` without its trainer state); return them."""
    orphans = [*checkpoints.glob(".step-*"), *checkpoints.glob(".latest.*")]
    pointer = checkpoints / "latest"
    newest = checkpoint_step(checkpoints / pointer.read_text().strip()) if pointer.exists() else -1
    orphans += [p for p in step_folders(checkpoints)
                if checkpoint_step(p) > newest and not (p / "trainer_state.pt").exists()]  # fmt: skip
    for path in orphans:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return orphans


def save_checkpoint(run_dir: Path, trainer: Trainer, loop_state: LoopState, tokenizer, keep: int = 0) -> Path:
    """Write step-<N>/ with weights and full training state, then delete all but the newest `keep` (0: none);
    return its path."""
    folder = Path(run_dir) / "checkpoints" / f"step-{loop_state.step}"
    remove_orphans(folder.parent)
    try:
        state = trainer.save(folder, tokenizer)  # LoRA: merged weights, the PEFT adapter in adapter/
    except SafetensorError as e:  # its I/O errors are not OSErrors ("No space left on device (os error 28)")
        raise OSError(errno.EIO, f"cannot write the checkpoint: {e}", str(folder)) from e
    state |= {
        "version": trainer.version,
        "num_skipped_steps": trainer.num_skipped_steps,
        "loop": dataclasses.asdict(loop_state),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    try:
        atomic_write(folder / "trainer_state.pt", lambda tmp: torch.save(state, tmp))
    except RuntimeError as e:  # torch's zip writer says "unexpected pos" for a full disk or a file-size limit
        if "inline_container" not in str(e):
            raise
        raise OSError(errno.EIO, f"a full disk or a file-size limit? ({e})", str(folder / "trainer_state.pt")) from e
    share_like_new_files(folder)
    sync_tree(folder)  # on disk before `latest` names it: a machine crash never leaves a named, cut-short checkpoint
    atomic_write_text(Path(run_dir) / "checkpoints" / "latest", folder.name)
    older = sorted(step_folders(folder.parent), key=checkpoint_step)[:-keep] if keep else []
    for old in (p for p in older if p != folder):
        shutil.rmtree(old, ignore_errors=True)
    return folder


def step_folders(checkpoints: Path) -> list[Path]:
    """The `step-<N>` folders Molt wrote (not a user's copy such as `step-4-best`, which it leaves alone)."""
    return [p for p in checkpoints.glob("step-*") if p.name[5:].isdigit()]


def checkpoint_step(folder: Path) -> int:
    """The loop step a checkpoint folder `step-<N>` was written at."""
    return int(folder.name.rsplit("-", 1)[1])


def check_written_by(run_dir: str, command: str) -> None:
    """A ConfigError naming ckpt.resume when `molt <command> --resume run_dir` would resume another command's run
    (its latest trainer state says which; one that cannot be read is left to the checks that read it)."""
    state = {}
    with contextlib.suppress(OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # tensors mapped, not read
        state = torch.load(latest_checkpoint(run_dir) / "trainer_state.pt", mmap=True, map_location="cpu",
                           weights_only=False)  # fmt: skip
    other = state.get("command", "train") if isinstance(state, dict) else command
    check(not state or other == command, "ckpt.resume", f"{run_dir} is a `molt {other}` run: resume it with `molt "
          f"{other} --resume {run_dir}`, or start from its model with --model.path {run_dir}")  # fmt: skip


def load_training_state(folder: Path, trainer: Trainer) -> LoopState:
    """Restore the trainer state (optimizer, schedule, extra models), version and RNG; return the loop state."""
    try:
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:  # cut short: a crash of the machine mid-write
        if isinstance(e, RuntimeError) and "zip archive" not in str(e):
            raise  # not a file cut short (e.g. CUDA tensors on a machine without CUDA): its own message
        latest, why = folder.parent / "latest", str(e).split(". ")[0]
        raise ConfigError(f"ckpt.resume: {folder / 'trainer_state.pt'} cannot be read, cut short ({why}); write an "
                          f"earlier step-N folder into {latest} to resume from it") from None  # fmt: skip
    if bool(state.get("sharded")) != trainer.sharded:
        written = "runtime.backend ray" if state.get("sharded") else "runtime.backend local"
        raise ConfigError(f"ckpt.resume: {folder} was written by {written}; resume it with the same backend")
    trainer.load(folder, state)  # sharded: any number of ranks, the shards are re-split on load
    trainer.version, trainer.num_skipped_steps = state["version"], state["num_skipped_steps"]
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    loop = LoopState(**state["loop"])
    loop.drops = collections.defaultdict(int, loop.drops)
    return loop
