"""`molt <command>`: flags generated from the config tree by tyro; `--config FILE` sets defaults.

Commands are registered functions taking the resolved `Config`; their docstrings are the top-level
help. Configuration errors are reported as one clear line (exit code 2), never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import tyro

from molt.config import Config, ConfigError

COMMANDS: dict[str, Callable[[Config], object]] = {}
DEFAULTS: dict[str, dict] = {}


def command(name: str, **defaults: dict):
    """Register `fn(cfg)` as `molt <name>`; `defaults` ({"group": {"field": value}}) change its defaults."""

    def wrap(fn):
        COMMANDS[name] = fn
        DEFAULTS[name] = defaults
        return fn

    return wrap


@command("train")
def train(cfg: Config) -> object:
    """Asynchronous RL (default: warm-started tiny model, GRPO on the calculator tool-use task)."""
    from molt.loop.run import run_train

    return run_train(cfg)


@command("sft", train={"lr": 2e-3, "max_steps": 150})
def sft(cfg: Config) -> object:
    """Supervised fine-tuning on chat data (loss on assistant tokens); writes an HF checkpoint."""
    from molt.train.sft import run_sft

    return run_sft(cfg)


@command("eval")
def eval_(cfg: Config) -> object:
    """Score a checkpoint, run directory or model folder on held-out rows: `molt eval TARGET` (pass@k, per-row)."""
    from molt.loop.eval_cmd import run_eval

    return run_eval(cfg)


@command("serve", chat={"port": 8000})
def serve(cfg: Config) -> object:
    """OpenAI/Anthropic-compatible chat server over a checkpoint: `molt serve CHECKPOINT` (= --model.path)."""
    from molt.agents.chat.serve import run_serve

    return run_serve(cfg)


def _config_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def parse_config(args: list[str], prog: str = "molt", command_name: str = "train") -> Config:
    """Resolve the config: defaults <- `--config` file <- flags.

    A bad file raises ConfigError; bad flags (and checks failing after flags apply) make tyro print
    the error naming the flag and exit with code 2.
    """
    from molt.cli.config_file import build, load_config_file

    path = _config_path(args)
    defaults = build(Config, DEFAULTS.get(command_name, {}))
    base = load_config_file(Config, path, base=defaults) if path else defaults
    return tyro.cli(Config, args=args, default=base, prog=prog, use_underscores=True)


def _resume_args(args: list[str]) -> list[str]:
    """`--resume DIR` = `--ckpt.resume DIR` with the run's own config.yaml as the config file."""
    args = ["--ckpt.resume" if a == "--resume" else a for a in args]
    if "--ckpt.resume" in args and _config_path(args) is None:
        run_dir = args[args.index("--ckpt.resume") + 1]
        args = ["--config", f"{run_dir}/config.yaml", *args]
    return args


def _run_of(target: str) -> Path | None:
    """The run directory `target` is (or is a checkpoint of), if any."""
    path = Path(target)
    if (path / "config.yaml").exists() and (path / "checkpoints").is_dir():
        return path
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").exists():
        return path.parent.parent
    return None


def _eval_args(target: str, args: list[str]) -> list[str]:
    """`molt eval TARGET` = `--model.path TARGET`, with the run's config.yaml as the config file when TARGET
    is a run or one of its checkpoints (its data, rollout and eval settings; not its run_dir)."""
    run = _run_of(target)
    base = ["--model.path", target]
    if run is not None and _config_path(args) is None:
        reset = ["--log.run_dir", "", "--ckpt.resume", "", "--model.tokenizer", ""]
        base = ["--config", str(run / "config.yaml"), *reset, *base]
    return base + args


def _usage() -> str:
    lines = ["usage: molt <command> [--config FILE] [--group.field VALUE ...]", "", "commands:"]
    lines += [f"  {name:<8} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in COMMANDS.items()]
    lines += ["", "`molt <command> --help` lists every flag with its help text and default."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `molt` executable (commands' return values are for programmatic use)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    name, rest = argv[0], argv[1:]
    if name == "serve" and rest and not rest[0].startswith("-"):
        rest = ["--model.path", *rest]  # `molt serve CHECKPOINT`
    if name == "eval" and rest and not rest[0].startswith("-"):
        rest = _eval_args(rest[0], rest[1:])  # `molt eval CHECKPOINT|RUN_DIR`
    if name not in COMMANDS:
        print(f"molt: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        raise SystemExit(2)
    try:
        cfg = parse_config(_resume_args(rest), prog=f"molt {name}", command_name=name)
    except ConfigError as e:
        print(f"molt {name}: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from molt.data.formats import DataError

    try:
        COMMANDS[name](cfg)
    except (ConfigError, DataError) as e:  # found at start-up (data rows, checkpoint): one line, no traceback
        print(f"molt {name}: {'data' if isinstance(e, DataError) else 'config'} error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
