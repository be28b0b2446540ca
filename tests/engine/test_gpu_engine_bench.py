"""`benchmarks/gpu_engine.py --smoke`: the GPU benchmark's own code, run on CPU at a tiny shape in a subprocess,
writes a complete report (every side and batch measured, no failed measurement)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_a_complete_report(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_engine_smoke.json").read_text())
    assert report["errors"] == [] and report["meta"]["smoke"]
    rows = {(r["side"], r["batch"]) for r in report["rows"]}
    assert rows == {(side, b) for side in ("Molt", "transformers") for b in report["setup"]["batches"]}
    for row in report["rows"]:
        assert row["tok_s"] > 0 and row["decode_tok_s"] > 0 and row["ttft_ms"] > 0 and row["roofline"] > 0
        if row["side"] == "Molt":
            assert row["new_tokens"] == report["setup"]["new_tokens"]
            assert 0 <= row["lp_mean"] <= row["lp_p99"] <= row["lp_max"] < 0.1  # bf16 rounding, not another function
    markdown = (tmp_path / "gpu_engine_smoke.md").read_text()
    assert "| batch | side |" in markdown and "Failed measurements" not in markdown
