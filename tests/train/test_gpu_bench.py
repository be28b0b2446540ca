"""`benchmarks/gpu_trainer.py --smoke` runs the GPU benchmark's code path on CPU and writes its report."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_trainer_benchmark_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_trainer.py"), "--smoke", "--iters", "1",
           "--results", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_trainer_smoke.json").read_text())
    systems = {(r["case"], r["system"]) for r in report["rows"] if "error" not in r}
    assert len(systems) == 10, report["rows"]  # 2 cases x (molt, +compile, +compile+AC, +AC, transformers)
    assert "| 128 sample | molt |" in (tmp_path / "gpu_trainer_smoke.md").read_text()
