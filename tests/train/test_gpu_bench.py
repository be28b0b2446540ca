"""`benchmarks/gpu_trainer.py --smoke` runs the GPU benchmark's code path on CPU (as a script, in this process)
and writes its report."""

import json
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_trainer_benchmark_smoke(tmp_path, monkeypatch):
    script = ROOT / "benchmarks" / "gpu_trainer.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke", "--iters", "1", "--results", str(tmp_path)])
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        torch._dynamo.reset()  # its compiled rows' graphs stay with the script
    report = json.loads((tmp_path / "gpu_trainer_smoke.json").read_text())
    systems = {(r["case"], r["system"]) for r in report["rows"] if "error" not in r}
    assert len(systems) == 10, report["rows"]  # 2 cases x (molt, +compile, +compile+AC, +AC, transformers)
    assert "| 128 sample | molt |" in (tmp_path / "gpu_trainer_smoke.md").read_text()
