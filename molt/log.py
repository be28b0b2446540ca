"""The run directory: resolved config, `metrics.jsonl`, and human-readable log lines.

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
    """A run's folder: `config.yaml` (loadable with --config), `metrics.jsonl`, checkpoints."""

    def __init__(self, path: str | os.PathLike, command: str, config: Any):
        if not path:
            path = Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        resolved = _plain(dataclasses.asdict(config))
        resolved.pop("config", None)
        atomic_write_text(self.path / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
        self.metrics_file = (self.path / "metrics.jsonl").open("a")
        self.start = time.perf_counter()

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one JSON object (one step) to metrics.jsonl."""
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()

    def print(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.metrics_file.close()
