"""Docs and `--help` name only flags that exist; the README's example commands parse as written."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import typing
from pathlib import Path

import pytest
import yaml
from conftest import small_model  # noqa: I001 - tests/conftest.py

import molt.config
from molt.cli.main import parse_command
from molt.config import Config
from molt.models import save_pretrained

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"--([a-z_]+\.[a-z0-9_.]*[a-z0-9_])")
CONFIG_FILES = [f"molt/config/{p.name}" for p in sorted((ROOT / "molt" / "config").glob("*.py"))]


def known_flags(cls: type = Config, prefix: str = "") -> set[str]:
    """Every `group.field` flag of the config tree (booleans also as `group.no_field`)."""
    flags, hints = set(), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            flags |= known_flags(hints[f.name], f"{prefix}{f.name}.")
        else:
            flags.add(prefix + f.name)
            if hints[f.name] is bool:
                flags.add(f"{prefix}no_{f.name}")
    return flags


@pytest.mark.parametrize("doc", ["README.md", "docs/algorithms.md", *CONFIG_FILES])
def test_every_flag_named_exists(doc):
    known = known_flags()
    text = (ROOT / doc).read_text()
    unknown = [
        f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: --{m[1]}" for m in FLAG.finditer(text) if m[1] not in known
    ]
    assert not unknown, unknown


def readme_commands() -> list[list[str]]:
    """The `molt ...` lines of the README's bash blocks, as argv (comments and `...` dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    commands = [shlex.split(line, comments=True) for line in lines if re.match(r"(\.venv/bin/)?molt ", line)]
    return [[a for a in argv[1:] if a != "..."] for argv in commands]


MODEL_FLAGS = ("--model.path", "--algo.teacher", "--critic.path")  # their values are HF model folders


def _workspace(tmp_path: Path, argv: list[str]) -> None:
    """The files the README's examples name, as a user would have them (any model folder they name, too)."""
    (tmp_path / "rows.jsonl").write_text('{"prompt": "What is 2+3?", "answer": "5"}\n')
    (tmp_path / "my_chats.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "answer": "hi"}\n'
    )  # as the README says: `{"messages": [...], "answer": ...}` (its `math` reward grades the answer)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "part-0.jsonl").write_text('{"question": "What is 2+3?", "solution": "5"}\n')
    (tmp_path / "my_reward.py").write_text("def fn(completion, row):\n    return float(row['answer'] in completion)\n")
    (tmp_path / "my_agent.py").write_text(
        "from molt.agents import Env, Result\n\n\nclass MyEnv(Env):\n"
        "    async def step(self, action):\n        return Result(reward=0.0, terminated=True)\n"
    )
    toml = re.search(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    (tmp_path / "run.toml").write_text(toml)  # the README's own config file example
    folders = [value for flag, value in zip(argv, argv[1:], strict=False) if flag in MODEL_FLAGS]
    folders.append(".cache/smollm2-135m-instruct")  # what examples/smollm2/prepare.py writes for the recipe
    folders.append("my_model")  # the README's config file example's
    run = tmp_path / "runs" / "train-<time>"  # the README's placeholder, literally
    model = small_model()
    for folder in [*folders, run / "checkpoints" / "step-1"]:
        save_pretrained(model, tmp_path / folder)
    (run / "checkpoints" / "latest").write_text("step-1")
    (run / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(Config())))))
    (tmp_path / "examples").symlink_to(ROOT / "examples")


def test_readme_has_example_commands():
    assert len(readme_commands()) >= 15


@pytest.mark.parametrize("argv", readme_commands(), ids=" ".join)
def test_readme_command_parses(argv, tmp_path, monkeypatch):
    _workspace(tmp_path, argv)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(molt.config.run, "check_device", lambda device: None)  # GPU examples on a CPU machine
    if not argv or "--help" in argv:
        pytest.skip("help output is tested in test_config.py")
    cfg = parse_command(argv)
    assert isinstance(cfg, Config)
    if argv[0] in ("train", "eval") and cfg.runtime.backend == "local":
        from molt.cli.inputs import load_inputs

        load_inputs(cfg)  # its data, reward function and agent load too
