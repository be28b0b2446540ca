"""`molt <command>`: flags generated from the config tree by tyro; `--config FILE` sets defaults.

Commands are registered functions taking the resolved `Config`; their docstrings are the top-level
help. Configuration errors are reported as one clear line (exit code 2), never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import tyro

from molt.config import Config, ConfigError

COMMANDS: dict[str, Callable[[Config], object]] = {}


def command(name: str):
    """Register `fn(cfg)` as `molt <name>`."""

    def wrap(fn):
        COMMANDS[name] = fn
        return fn

    return wrap


@command("sft")
def sft(cfg: Config) -> object:
    """Supervised fine-tuning on chat data (loss on assistant tokens); writes an HF checkpoint."""
    from molt.train.sft import run_sft

    return run_sft(cfg)


def _config_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def parse_config(args: list[str], prog: str = "molt") -> Config:
    """Resolve the config: defaults <- `--config` file <- flags.

    A bad file raises ConfigError; bad flags (and checks failing after flags apply) make tyro print
    the error naming the flag and exit with code 2.
    """
    from molt.cli.config_file import load_config_file

    path = _config_path(args)
    base = load_config_file(Config, path) if path else Config()
    return tyro.cli(Config, args=args, default=base, prog=prog, use_underscores=True)


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
    if name not in COMMANDS:
        print(f"molt: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        raise SystemExit(2)
    try:
        cfg = parse_config(rest, prog=f"molt {name}")
    except ConfigError as e:
        print(f"molt {name}: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    COMMANDS[name](cfg)


if __name__ == "__main__":
    main()
