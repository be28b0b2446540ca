"""docs/algorithms.md names every `--algo.*` and `--critic.*` flag (and LoRA's) exactly as the CLI spells it."""

import dataclasses
import re
from pathlib import Path

from molt.config import AlgoConfig, CriticConfig, TrainConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def _flag(group: str, f: dataclasses.Field) -> str:
    """The flag that changes `f` from its default: booleans that default to True are switched off by `no_`."""
    return f"--{group}.no_{f.name}" if f.default is True else f"--{group}.{f.name}"


def test_every_algo_and_critic_flag_is_documented():
    named = set(re.findall(r"--[a-z_]+\.[a-z0-9_]+", DOC.read_text()))
    fields = [("algo", f) for f in dataclasses.fields(AlgoConfig)] + [
        ("critic", f) for f in dataclasses.fields(CriticConfig)
    ]
    fields += [("train", f) for f in dataclasses.fields(TrainConfig) if f.name.startswith("lora_")]
    missing = sorted({_flag(group, f) for group, f in fields} - named)
    assert not missing, missing
