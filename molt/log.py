"""The run directory: resolved config, `metrics.jsonl`, TensorBoard events, plots, log lines.

Every write that a resumed or crashed run depends on is atomic (temp file, then rename).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temp file in the same folder and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class RunDir:
    """A run's folder: `config.yaml` (loadable with --config), `metrics.jsonl`, `tb/`, checkpoints."""

    def __init__(self, path: str | os.PathLike, command: str, config: Any, tensorboard: bool = True):
        if not path:
            path = Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        resolved = _plain(dataclasses.asdict(config))
        resolved.pop("config", None)
        atomic_write_text(self.path / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
        self.metrics_file = (self.path / "metrics.jsonl").open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.path / "tb"))
        self.start = time.perf_counter()

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one JSON object (one step) to metrics.jsonl and its scalars to TensorBoard."""
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        if self.tb is not None:
            step = int(metrics.get("step", 0))
            for key, value in metrics.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)

    def print(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.metrics_file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a run's metrics.jsonl."""
    lines = (Path(path) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


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
