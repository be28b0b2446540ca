"""The run directory: resolved config, `metrics.jsonl`, TensorBoard events, plots, log lines; optional W&B.

Every write that a resumed or crashed run depends on is atomic (temp file, then rename). Weights & Biases
(`--log.wandb_project`) receives the same scalars as metrics.jsonl; `wandb` is imported only then, so it
stays an optional dependency (`pip install molt[wandb]`)."""

from __future__ import annotations

import decimal
import errno
import fcntl
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """Write `path` with `write(temp path)` into a temp file in the same folder, flushed to disk, then an atomic
    rename (so a crash of the machine leaves the old file or the whole new one, never a renamed, cut-short one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        sync_tree(tmp)
        os.replace(tmp, path)
        sync_tree(path.parent, files=False)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def sync_tree(path: Path, files: bool = True) -> None:
    """fsync `path` (a file, or a folder with, if `files`, every file under it) so what a later rename publishes is
    on disk; a file system that cannot sync a folder is left as it is."""
    paths = [*path.rglob("*"), path] if path.is_dir() and files else [path]
    for p in sorted((p for p in paths if not p.is_symlink()), key=lambda p: p.is_dir()):  # files, then folders
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP) or not p.is_dir():
                raise
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def json_safe(value: Any) -> Any:
    """`value` as JSON that strict readers take, never failing: containers walked (other keys as str), non-finite
    floats as "nan"/"inf", arrays and tensors as lists or numbers, a Decimal as its digits, a date or time as ISO
    text, anything else (an image, bytes, an object) as its repr, or a `<type>` tag where that is long or has an
    address."""
    if isinstance(value, dict):
        return {k if isinstance(k, str | int | float | bool | None) else str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(float(value))
    if isinstance(value, str | int | float | bool | None):
        return value
    if isinstance(value, decimal.Decimal):
        return str(value)
    try:
        return json_safe(value.isoformat() if hasattr(value, "isoformat") else value.tolist())
    except Exception:  # noqa: BLE001 - no (working) tolist
        text = repr(value)
        return text if len(text) <= 100 and " at 0x" not in text else f"<{type(value).__name__}>"


def default_run_dir(command: str) -> Path:
    """`runs/<command>-<time>`, with a `-2`, `-3`, ... suffix when a run started in the same second."""
    base = Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


LOCK = ".lock"  # held (flock) by the process writing a run directory, for as long as it runs


def check_new_run_dir(path: str | os.PathLike) -> None:
    """A ConfigError naming log.run_dir when `path` already holds files (a new run must not mix into an old one)."""
    from molt.config import ConfigError, check

    path = Path(path)
    if path.is_dir() and any(p.name != LOCK for p in path.iterdir()):
        started, metrics = (path / "config.yaml").exists(), path / "metrics.jsonl"
        if started and not (path / "checkpoints").exists() and not (metrics.exists() and metrics.stat().st_size):
            return  # a run that stopped before logging anything (e.g. a bad model folder): it starts again here
        resume = f", or continue that run with --resume {path}" if (path / "checkpoints" / "latest").exists() else ""
        held = "a run" if started else "files"
        raise ConfigError(f"log.run_dir: {path} already holds {held}; pick a new --log.run_dir (or remove it){resume}")
    check(path.is_dir() or not path.exists(), "log.run_dir", f"{path} is a file, not a folder")


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of one metrics row other than `step` (what TensorBoard and W&B plot)."""
    return {k: v for k, v in metrics.items() if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}


def start_wandb(run_path: Path, log_cfg: Any, config: dict[str, Any]) -> Any:
    """The Weights & Biases run of a run directory; resuming the directory resumes the same W&B run."""
    import wandb  # optional: LogConfig checked at start-up that it is installed

    from molt.config import ConfigError

    id_file = run_path / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    atomic_write_text(id_file, run_id)
    try:
        return wandb.init(project=log_cfg.wandb_project, entity=log_cfg.wandb_entity or None, mode=log_cfg.wandb_mode,
                          name=log_cfg.wandb_name or run_path.name, dir=str(run_path), id=run_id, resume="allow",
                          config=config, reinit="create_new")  # fmt: skip
    except wandb.errors.Error as e:  # no login (UsageError), a refused key, no network
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = "" if log_cfg.wandb_mode == "offline" else ", or log offline with --log.wandb_mode offline"
        raise ConfigError(f"log.wandb_project: W&B did not start ({why}); run `wandb login` (or set WANDB_API_KEY)"
                          f"{offline}") from None  # fmt: skip


class RunDir:
    """A run's folder: `config.yaml` (loadable with --config), `metrics.jsonl`, `tb/`, checkpoints; W&B if asked.
    Held (locked) from its creation until `close`, which leaving a `with RunDir(...)` block calls."""

    def __init__(
        self, path: str | os.PathLike, command: str, config: Any, tensorboard: bool = True, resumed: int | None = None
    ):
        """`resumed`: the step a resumed run goes on from; the rows logged after it (an interrupted tail) are
        dropped, so metrics.jsonl and TensorBoard hold each step once."""
        from molt.config import ConfigError

        given = Path(path) if path else default_run_dir(command)
        self.path = given.absolute()  # agent code may os.chdir
        resolved = config.file_form()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock = hold(self.path / LOCK, given)  # released by `close`, or when this process ends
        except OSError as e:  # a read-only folder, a full disk
            raise ConfigError(f"log.run_dir: cannot write the run directory {given}: {e.strerror}") from None
        try:
            self._open(given, config, resolved, tensorboard, resumed)
        except BaseException:
            for part in (getattr(self, "metrics_file", None), getattr(self, "tb", None), self.lock):
                if part is not None:
                    part.close()  # a retry in this process (a notebook) must find the folder free, no writer left
            raise

    def _open(self, given: Path, config: Any, resolved: dict, tensorboard: bool, resumed: int | None) -> None:
        """Write config.yaml, trim a resumed run's tail, open metrics.jsonl, TensorBoard and W&B."""
        from molt.config import ConfigError

        try:
            atomic_write_text(self.path / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
        except OSError as e:  # a read-only folder, a full disk
            raise ConfigError(f"log.run_dir: cannot write the run directory {given}: {e.strerror}") from None
        metrics = self.path / "metrics.jsonl"
        if resumed is not None and metrics.exists():
            kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= resumed]
            atomic_write_text(metrics, "".join(json.dumps(row) + "\n" for row in kept))
        self.metrics_file = metrics.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.path / "tb"), purge_step=None if resumed is None else resumed + 1)
        self.wandb = start_wandb(self.path, config.log, resolved) if config.log.wandb_project else None
        self.start = time.perf_counter()

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one JSON object (one step) to metrics.jsonl and its scalars to TensorBoard (and W&B)."""
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        step, scalars = int(metrics.get("step", 0)), _scalars(metrics)
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def print(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # also on a failure: a retry in this process finds the run directory free

    def close(self) -> None:
        try:
            self.metrics_file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()
        finally:
            self.lock.close()  # the folder is free for a resume


def hold(file: Path, run_dir: Path) -> IO:
    """`file` open and locked (flock) by this process; a ConfigError if another process (or an unclosed `RunDir` of
    this one) holds it. On a filesystem without flock (some Lustre, NFS and FUSE mounts) unlocked, with a warning."""
    from molt.config import ConfigError

    handle = file.open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # two runs (or a resume beside its still running run) would overwrite each other
        handle.close()
        raise ConfigError(f"log.run_dir: {run_dir} is in use by another molt process (or an earlier run of this one, "
                          "not closed); wait for it to end or pick another --log.run_dir") from None  # fmt: skip
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
            handle.close()
            raise
        print(f"warning: {file}: cannot lock ({e.strerror}): nothing keeps a second process out", file=sys.stderr)
    return handle


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a run's metrics.jsonl; a last line cut short (a full disk, a crash) is left out with a warning."""
    file = Path(path) / "metrics.jsonl"
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number < len(lines):
                from molt.config import ConfigError

                raise ConfigError(f"{file}:{number}: not a JSON row ({e.msg}); remove or mend that line") from None
            print(f"warning: {file}:{number}: a row cut short (a full disk or a crash) is left out", file=sys.stderr)
    return rows


def plot_metrics(run_dir: str | os.PathLike, keys: list[str], out_name: str = "curves.png") -> Path:
    """PNG with one panel per metric key (x = step), written into the run directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [(r["step"], r[key]) for r in rows if key in r and "step" in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker="." if len(points) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / out_name
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
