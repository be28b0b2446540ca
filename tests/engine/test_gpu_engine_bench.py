"""`benchmarks/gpu_engine.py --smoke`: the GPU benchmark's own code, run as a script (in this process, with its
`__main__`) on CPU at a tiny shape, writes a complete report (every side and batch measured, no failed
measurement)."""

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_a_complete_report(tmp_path, monkeypatch):
    script = ROOT / "benchmarks" / "gpu_engine.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke", "--out", str(tmp_path)])
    runpy.run_path(str(script), run_name="__main__")
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
