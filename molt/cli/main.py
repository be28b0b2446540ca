"""`molt <command>`: flags generated from the config tree by tyro; `--config FILE` sets defaults.

Commands are registered functions taking the resolved `Config` (docstring = top-level help), each assembling its
run in its own module here. A `UserError` is one line `molt <command>: <kind>: <message>` with exit code 2 and no
traceback (`MOLT_TRACEBACK=1` adds it); anything else is a bug in Molt, printed with its traceback, exit code 1."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import os
import signal
import socket
import sys
import threading
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import tyro

from molt.cli.signals import TERMINATED, on_sigterm
from molt.config import Config, ConfigError, check
from molt.config.rl import check_rollout_algo
from molt.config.training import check_rl_batch
from molt.errors import RunFatalError, UserError, VariantFailure

COMMANDS: dict[str, Callable[[Config], object]] = {}
DEFAULTS: dict[str, dict] = {}
UNUSED: dict[str, tuple[str, ...]] = {}  # command -> config groups (and keys) whose flags it refuses


def _all_but(group: str, *used: str) -> tuple[str, ...]:
    """The keys of config group `group` other than `used` (the RL-only settings a command does not read)."""
    fields = dataclasses.fields(typing.get_type_hints(Config)[group])
    return tuple(f"{group}.{f.name}" for f in fields if f.name not in used)


WARM_START_FIELDS = ("warmstart_steps", "warmstart_lr")
WARM_START = tuple(f"model.{k}" for k in WARM_START_FIELDS)  # `molt train`'s preset warm start only
RL_TRAINER = ("check_tokens", "share_prefix", "logprob_chunk_tokens", "activation_checkpointing", "compile")
RL_TRAINER += ("compile_backend",)  # `train` settings of the RL trainer that `molt sft` does not read
ENGINE = ("engine_threads", "engine_compile", "engine", "kv_cache", "kv_memory_fraction", "kv_gb", "cuda_graphs")
BACKEND = _all_but("runtime", "device", "threads", *ENGINE)  # backend and Ray's: only `molt train` runs on Ray
SAMPLING = ("temperature", "top_p", "top_k")  # rollout settings `molt serve` reads (max_tokens is chat's)
EPISODE = ("agent", "reward", "reward_weights", "top_p", "top_k", "max_tokens", "max_turns", "max_len")
EPISODE += ("step_timeout_s", "agent_workers")  # rollout settings `molt eval` reads (temperature is eval's)
NO_RL = ("algo", "critic", *BACKEND, *WARM_START)  # what `molt sft`, `eval` and `serve` do not read
SFT_UNUSED = (*NO_RL, "rollout", "eval", "chat", *(f"runtime.{k}" for k in ENGINE))
SFT_UNUSED += tuple(f"train.{k}" for k in RL_TRAINER)
EVAL_UNUSED = (*NO_RL, "ckpt", *_all_but("rollout", *EPISODE), *_all_but("train", "seed"), "eval.every", "log.every")
SERVE_UNUSED = (*NO_RL, "ckpt", "data", "eval", "log", *_all_but("rollout", *SAMPLING), *_all_but("train", "seed"))


def command(name: str, unused: tuple[str, ...] = (), **defaults: dict):
    """Register `fn(cfg)` as `molt <name>`; `defaults` ({"group": {"field": value}}) change its defaults; a flag
    of an `unused` config group (or dotted key) is refused (a config file shared with other commands may set them)."""

    def wrap(fn):
        COMMANDS[name], DEFAULTS[name], UNUSED[name] = fn, defaults, unused
        return fn

    return wrap


@command("train", unused=("eval.output", "chat.max_len", "chat.max_tokens"))  # `molt eval`'s, `molt serve`'s
def train(cfg: Config) -> object:
    """Asynchronous RL (default: warm-started tiny model, GRPO on the calculator tool-use task).

    `molt train --resume RUN_DIR` continues a run from its latest checkpoint (with its config.yaml; flags change
    it); `molt train --replay RUN_DIR` trains again on the batches a `--rollout.dump` run wrote."""
    from molt.cli.train import run_train

    return run_train(cfg)


@command("sft", unused=SFT_UNUSED, train={"lr": 2e-3, "max_steps": 150})
def sft(cfg: Config) -> object:
    """Supervised fine-tuning on chat data (loss on assistant tokens); writes an HF checkpoint.

    `--ckpt.every N` also saves resumable checkpoints: `molt sft --resume RUN_DIR` continues the run."""
    from molt.cli.sft import run_sft

    return run_sft(cfg)


@command("eval", unused=EVAL_UNUSED)
def eval_(cfg: Config) -> object:
    """Score a checkpoint, run directory or model folder on held-out rows: `molt eval TARGET` (pass@k, per-row)."""
    from molt.cli.eval import run_eval

    return run_eval(cfg)


@command("serve", unused=SERVE_UNUSED, chat={"port": 8000})
def serve(cfg: Config) -> object:
    """OpenAI/Anthropic-compatible chat server over a checkpoint: `molt serve CHECKPOINT` (= --model.path)."""
    from molt.cli.serve import run_serve

    return run_serve(cfg)


def _config_path(args: list[str]) -> str | None:
    """The `--config` file `args` name, if any (one at most)."""
    paths = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    paths += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    check(len(paths) < 2, "--config", f"given {len(paths)} times ({', '.join(paths)}); merge the files or use flags")
    return paths[0] if paths else None


STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.ENOENT, errno.EACCES}


def _internal_error(name: str, e: Exception) -> NoReturn:
    """Not the user's doing: a bug in Molt, shown in full; unless a variant of the user's own failed (its output
    refused by Molt's checks, or an exception in its code), a user error naming it, its flag and its file."""
    from molt.algo import FAMILIES
    from molt.registry import variant_failure

    if (problem := variant_failure(e, FAMILIES)) is not None:
        failure = VariantFailure(problem)
        failure.__cause__ = e  # MOLT_TRACEBACK=1 shows where
        fail(f"molt {name}", failure)
    traceback.print_exception(e)
    print(f"molt {name}: internal error: {type(e).__name__}: {e}\n  this is a bug in Molt (not in your config, "
          "data or agent); please report it with the traceback above", file=sys.stderr)  # fmt: skip
    raise SystemExit(1) from None


def _traceback_wanted() -> bool:
    """`MOLT_TRACEBACK` set to a true value (1, true, yes, on)."""
    return os.environ.get("MOLT_TRACEBACK", "").strip().lower() in ("1", "true", "yes", "on")


def _flag_keys(args: list[str]) -> frozenset[str]:
    """The dotted keys that flags in `args` set (`--data.no_shuffle` sets data.shuffle)."""
    keys = {a[2:].split("=", 1)[0].replace("-", "_") for a in args if a.startswith("--") and "." in a}
    return frozenset(keys | {k.replace(".no_", ".", 1) for k in keys})


def parse_config(args: list[str], prog: str = "molt", command_name: str = "train") -> Config:
    """Resolve the config: defaults <- `--config` file <- flags. A bad file raises ConfigError; a bad flag exits
    with code 2 after one line naming it (a value the checks reject, or tyro's own message)."""
    from molt.cli.config_file import build

    args, path = _bool_words(args), _config_path(args)
    defaults = build(Config, DEFAULTS.get(command_name, {}))
    unused = UNUSED.get(command_name, ())
    base = _file_config(path, defaults, _flag_keys(args), frozenset(unused)) if path else defaults
    for key in sorted(_flag_keys(args)):  # before the groups' own checks, which may name other flags
        if (group := key.split(".")[0]) in unused or key in unused:
            what = f"the {group} settings" if group in unused else "this setting"
            raise ConfigError(f"{key}: `{prog}` does not use {what}; drop the flag")
    wants_help = "-h" in args or "--help" in args
    try:
        schema = _without(tuple(u for u in unused if "." not in u)) if wants_help else Config
        about = inspect.cleandoc(COMMANDS[command_name].__doc__ or "") if command_name in COMMANDS else None
        return tyro.cli(schema, args=args, default=base, prog=prog, description=about, use_underscores=True)
    except ConfigError as e:  # a check a flag made fail may name a key the file set: say where (a resumed run's)
        fail(prog, _in_file(e, args))
    except UserError as e:
        fail(prog, e)


def _file_config(path: str, defaults: Config, flags: frozenset[str], unused: frozenset[str]) -> Config:
    """The file's config, which the flags then change and the result is checked. When the file alone does not pass
    the checks: without each key an error names that the command does not read (`unused`: e.g. a run's teacher
    folder, since deleted, for `molt eval RUN`) or a flag replaces, then without all of those (a bad value a flag
    mends that another key's check names); else the error about a value neither unused nor replaced."""
    from molt.cli.config_file import load_config_file

    skip, skippable = frozenset(), unused | flags
    while True:
        try:
            return load_config_file(Config, path, base=defaults, skip=skip)
        except ConfigError as e:
            key = getattr(e, "key", "")
            if key not in skip and {key, key.split(".")[0]} & skippable:
                skip |= {key}
            elif not skippable <= skip:
                skip |= skippable
            else:
                raise


def _without(groups: tuple[str, ...]) -> type:
    """`Config` with `groups` hidden from `--help` (a command's unused groups: their flags are refused)."""
    hints, fields = typing.get_type_hints(Config), {f.name: f for f in dataclasses.fields(Config)}
    hidden = {name: dataclasses.field(default_factory=fields[name].default_factory) for name in groups}
    hidden["__annotations__"] = {name: typing.Annotated[hints[name], tyro.conf.Suppress] for name in groups}
    return dataclasses.dataclass(type("Config", (Config,), hidden))


def _alias(args: list[str], short: str, flag: str, missing: str) -> tuple[list[str], str | None]:
    """`args` with `short` spelled `flag`, and the flag's value when no `--config` is given (None otherwise);
    a ConfigError naming the flag's key and saying `missing` when the flag has no value."""
    args = [flag if a == short else a for a in args]
    if flag not in args or _config_path(args) is not None:
        return args, None
    at = args.index(flag) + 1
    value = args[at] if at < len(args) else ""
    check(bool(value) and not value.startswith("--"), flag[2:], missing)
    return args, value


def _resume_args(args: list[str], command_name: str) -> list[str]:
    """`--resume DIR` = `--ckpt.resume DIR` with the run's own config.yaml as the config file, continuing in DIR
    (wherever the run was first written; a later `--log.run_dir` still wins); DIR must be a run of this command."""
    from molt.loop.checkpoint import check_written_by

    missing = "--resume needs a run directory, e.g. --resume runs/train-<time>"
    args, run_dir = _alias(args, "--resume", "--ckpt.resume", missing)
    if run_dir is None:
        return args
    check_written_by(run_dir, command_name)  # before its config.yaml, whose settings the other command may refuse
    _check_same_backend(run_dir, args)
    return ["--config", str(run_config(run_dir)), "--log.run_dir", str(Path(run_dir).resolve()), *args]


def _check_same_backend(run_dir: str, args: list[str]) -> None:
    """A ConfigError when `--runtime.backend` in `args` is not the one `run_dir` was trained with, before the run's
    config.yaml is read (its Ray settings would be blamed instead: the checkpoint's layout is what differs)."""
    import yaml

    given = [v for f, v in zip(args, [*args[1:], ""], strict=True) if f == "--runtime.backend"]
    given += [a.split("=", 1)[1] for a in args if a.startswith("--runtime.backend=")]
    if not given:
        return
    with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
        was = (yaml.safe_load(run_config(run_dir).read_text()).get("runtime") or {}).get("backend", "local")
        check(given[-1] == was, "ckpt.resume", f"runtime.backend is {given[-1]} here but {was} in {run_dir}; its "
              "checkpoint holds the other training state (ray writes sharded ones): keep the run's backend, or start "
              f"a new run from its policy with --model.path {run_dir}")  # fmt: skip


def check_resume_config(run_dir: str | None, path: str | os.PathLike | None) -> None:
    """A ConfigError when a resume of `run_dir` is given a config file other than the run's own config.yaml: the run
    would go on with that file's settings (every setting it leaves out at its default), silently another job."""
    if run_dir and path and Path(path).resolve() != (Path(run_dir) / "config.yaml").resolve():
        raise ConfigError(f"ckpt.resume: the config file {path} would replace {run_dir}'s own config.yaml, so the run "
                          f"would go on as another job; resume with --resume {run_dir} and change a setting with its "
                          "flag")  # fmt: skip


def run_config(run_dir: str) -> Path:
    """The config.yaml of run directory `run_dir` (a ConfigError naming ckpt.resume if it is none)."""
    check(Path(run_dir).is_dir(), "ckpt.resume", f"run directory {run_dir!r} does not exist")
    check((Path(run_dir) / "config.yaml").exists(), "ckpt.resume",
          f"{run_dir} has no config.yaml, so it is not a Molt run directory")  # fmt: skip
    return Path(run_dir) / "config.yaml"


def _replay_args(args: list[str]) -> list[str]:
    """`--replay DIR` = `--rollout.replay DIR`, with the dumped run's config.yaml (when DIR is a run or its
    rollouts folder) as the config file: its seed, model and algorithm; not its run_dir or resume."""
    missing = "--replay needs a run directory (or its rollouts folder) with a dump"
    args, target = _alias(args, "--replay", "--rollout.replay", missing)
    folders = (Path(target), Path(target).parent) if target else ()
    run = next((p for p in folders if (p / "config.yaml").exists()), None)
    if run is None:
        return args
    return ["--config", str(run / "config.yaml"), "--log.run_dir", "", "--ckpt.resume", "", *args]


def run_of(target: str) -> Path | None:
    """The run directory `target` is (or is a checkpoint of), if any: `molt train`'s (checkpoints/STEP) or
    `molt sft`'s (checkpoint/)."""
    path = Path(target)
    if (path / "config.yaml").exists() and any((path / name).is_dir() for name in ("checkpoints", "checkpoint")):
        return path
    run = path.parent.parent if path.parent.name == "checkpoints" else None
    run = path.parent if path.name == "checkpoint" else run
    return run if run is not None and (run / "config.yaml").exists() else None


def _eval_args(target: str, args: list[str]) -> list[str]:
    """`molt eval TARGET` = `--model.path TARGET`, with the run's config.yaml as the config file when TARGET
    is a run or one of its checkpoints (its data, rollout and eval settings; not its run_dir; not its training data
    when `--data.eval_path` names the rows to score)."""
    run = run_of(target)
    base = ["--model.path", target]
    if run is not None and _config_path(args) is None:
        reset = ["--log.run_dir", "", "--model.tokenizer", ""]  # eval reads no ckpt settings
        if "data.eval_path" in (flags := _flag_keys(args)) and "data.path" not in flags:
            reset += ["--data.path", ""]  # the run's training file need not exist any more
        base = ["--config", str(run / "config.yaml"), *reset, *base]
    return base + args


def _usage() -> str:
    lines = ["usage: molt <command> [--config FILE] [--group.field VALUE ...]", "", "commands:"]
    lines += [f"  {name:<8} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in COMMANDS.items()]
    lines += ["", "`molt <command> --help` lists every flag with its help text and default; `molt --version`."]
    return "\n".join(lines)


# rollout settings a replay never reads (the dump holds what they made): its flags are refused
# (not max_tokens: the overlong penalty's budget may be it)
REPLAY_UNREAD = ("agent", "reward", "reward_weights", "prompts_per_step", "n_samples_per_prompt", "sync_mode", "top_p",
                 "top_k", "max_turns", "step_timeout_s", "max_failure_frac", "filters", "filter_on", "score_range",
                 "max_in_flight", "agent_workers")  # fmt: skip


def _refuse_inert_flags(cfg: Config, flags: frozenset[str], command_name: str) -> None:
    """A ConfigError for a flag its command would not read in this config: a preset's settings beside a model
    folder, eval settings with no eval, W&B settings with W&B off, a data file's settings without one, what a
    replay (no engine, no eval) never reads (a config file may still set them: a run's config.yaml records every
    setting)."""
    inert: dict[str, str] = {}
    if cfg.model.path:
        keys = (f"model.{k}" for k in ("preset", "init_std", *WARM_START_FIELDS))
        inert |= dict.fromkeys(keys, "here: the model comes from --model.path")
    if command_name == "train" and not cfg.eval.every:
        keys = (f"eval.{k}" for k in ("num_prompts", "n_samples", "temperature", "seed"))
        inert |= dict.fromkeys(keys, "here: no eval runs (--eval.every 0)")
    if command_name == "sft" and not cfg.ckpt.every:
        inert["ckpt.keep"] = "here: molt sft keeps resumable checkpoints only with --ckpt.every N"
    if not cfg.log.wandb_project:
        keys = (f"log.{k}" for k in ("wandb_mode", "wandb_entity", "wandb_name"))
        inert |= dict.fromkeys(keys, "here: W&B is off (no --log.wandb_project)")
    if not (cfg.data.path or cfg.data.eval_path):
        inert |= dict.fromkeys(("data.shuffle", "data.split"), "here: a built-in task's rows are generated as they are")
    if cfg.rollout.replay and command_name == "train":  # (`molt eval` of a replay run reads its config.yaml)
        unread = [f"runtime.{k}" for k in ENGINE if k != "engine_threads"]  # the replay's compute threads: read
        unread += ["runtime.engines", "runtime.engine_restarts", "runtime.engine_timeout_s"]  # Ray's replicas
        unread += [f"rollout.{k}" for k in REPLAY_UNREAD]
        unread += [f"eval.{k}" for k in ("num_prompts", "n_samples", "temperature", "seed", "output")]
        unread += [k for k in flags if k.startswith("chat.")]
        inert |= dict.fromkeys(unread, "with --replay, which trains on the dump's batches without an engine or eval")
        if cfg.config:  # the run's config.yaml holds the temperature the dump was sampled at
            inert["rollout.temperature"] = ("with --replay but to change its losses: the trainer's log-probs take "
                                            "the temperature the dump was sampled at, the run's")  # fmt: skip
    for key in sorted(flags & inert.keys()):
        raise ConfigError(f"{key}: has no effect {inert[key]}; drop the flag")


def parse_command(argv: list[str]) -> Config:
    """The checked config of `molt <argv...>` (a known command), before anything is built; UserError if wrong.
    Positional targets, `--resume` and `--replay` are spelled out as flags; then the checks that need the command
    or user code as well as the config."""
    from molt.cli.inputs import check_user_code

    name, rest = argv[0], argv[1:]
    if name == "serve" and rest and not rest[0].startswith("-"):
        rest = ["--model.path", *rest]  # `molt serve CHECKPOINT`
    if name == "eval" and rest and not rest[0].startswith("-"):
        rest = _eval_args(rest[0], rest[1:])  # `molt eval CHECKPOINT|RUN_DIR`
    args = _resume_args(_replay_args(rest), name)
    cfg = parse_config(args, prog=f"molt {name}", command_name=name)
    check_resume_config(cfg.ckpt.resume, cfg.config)  # as parsed: `--ckpt.resume=RUN`, or set by the file itself
    flags = _flag_keys(args)
    _refuse_inert_flags(cfg, flags, name)
    try:
        check_user_code(cfg, flags if name in ("train", "eval") else ())  # serve always chats
        if name == "train":  # `train_async` checks them again for the Python API; here a file's line is named
            check_rollout_algo(cfg.rollout, cfg.algo)
            check_rl_batch(cfg.train, cfg.rollout.max_len)
    except ConfigError as e:
        raise _in_file(e, args) from None
    if name == "serve" or cfg.rollout.agent:  # a chat server may run: its address must be one to listen on
        check_port(cfg.chat.host, cfg.chat.port)
    return cfg


BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False, "1": True, "0": False}


def _bool_words(args: list[str]) -> list[str]:
    """`--group.flag true|false` (or `=false`), as a config file's user writes a boolean, as tyro spells it:
    `--group.flag` / `--group.no_flag`, or `--group.flag True|False` for one that may also be None (unset)."""
    hints = {f"--{g}.{k}": tp for g, cls in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(cls)
             for k, tp in typing.get_type_hints(cls).items()}  # fmt: skip
    bools = {flag for flag, tp in hints.items() if tp is bool or tp == bool | None}
    out: list[str] = []
    for arg in args:
        flag, eq, word = arg.partition("=")
        if not eq and out and out[-1] in bools:  # `--group.flag word`: the word may be its value
            flag, word = out[-1], arg
        if flag not in bools or word.lower() not in BOOL_WORDS:
            out.append(arg)
            continue
        if not eq:
            out.pop()
        value = BOOL_WORDS[word.lower()]
        out += [flag, str(value)] if hints[flag] is not bool else [flag if value else flag.replace(".", ".no_", 1)]
    return out


def _in_file(error: ConfigError, args: list[str]) -> ConfigError:
    """`error` (naming its key first) with the `--config` file and line that set the key, when a file did."""
    from molt.cli.config_file import read_file

    key, path = str(error).split(":", 1)[0], _config_path(args)
    line = read_file(path)[1].get(key) if path and key not in _flag_keys(args) else None
    return ConfigError(f"{path}:{line}: {error}") if line else error


def check_port(host: str, port: int) -> None:
    """A ConfigError naming chat.host when no address of this machine is `host`, or chat.port when another process
    already listens on (host, port) (port 0: any free one)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT does not count
        try:
            probe.bind((host, port))
        except socket.gaierror as e:
            raise ConfigError(f"chat.host: cannot listen on {host!r} ({e.strerror or e}): give an address of this "
                              "machine (127.0.0.1, 0.0.0.0 for every interface)") from None  # fmt: skip
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"chat.host: {host!r} is not an address of this machine ({e.strerror})") from None
            raise ConfigError(
                f"chat.port: cannot listen on {host}:{port} ({e.strerror or e}); another process uses it: "
                "stop it or pick a free port with --chat.port (0 = any free port)"
            ) from None


def fail(prog: str, error: UserError) -> NoReturn:
    """Print a user error as one line (its traceback first with MOLT_TRACEBACK=1) and exit with code 2."""
    if _traceback_wanted():
        traceback.print_exception(error)
    message = " ".join(str(error).split("\n"))
    print(f"{prog}: {error.kind}: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `molt` executable (commands' return values are for programmatic use)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    if argv[0] == "--version":
        from molt import __version__

        print(f"molt {__version__}")
        return
    name = argv[0]
    if name not in COMMANDS:
        print(f"molt: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        raise SystemExit(2)
    TERMINATED.clear()
    main_thread = threading.current_thread() is threading.main_thread()  # where signal handlers may be set
    on_term = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None  # `timeout`, Slurm, k8s: as Ctrl-C
    cfg = None
    try:
        cfg = parse_command(argv)
        COMMANDS[name](cfg)
    except UserError as e:
        fail(f"molt {name}", e)
    except KeyboardInterrupt:
        how, code = ("terminated (SIGTERM)", 143) if TERMINATED else ("interrupted", 130)
        saves = name == "train" or (name == "sft" and cfg is not None and cfg.ckpt.every)
        kept = " (the run directory keeps the checkpoints saved so far)" if saves else ""
        print(f"molt {name}: {how}{kept}", file=sys.stderr)
        if any(t.name == "molt-build" and t.is_alive() for t in threading.enumerate()):
            sys.stderr.flush()  # a warm start or model load still runs torch on its thread: exiting the
            os._exit(code)  # interpreter under it aborts the process, so leave at once (nothing else holds state)
        raise SystemExit(code) from None
    except BrokenPipeError:  # `molt train --help | head`: the reader left; nothing more to say
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stdout with no file (captured)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush would fail again
        raise SystemExit(1) from None
    except RunFatalError as e:  # the run cannot go on (e.g. a cluster that cannot place or keep its actors)
        if _traceback_wanted():
            traceback.print_exception(e)
        print(f"molt {name}: run stopped: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as e:  # a storage error is the machine's doing: a full disk, a file-size limit, a folder made
        if e.errno not in STORAGE_ERRNOS:  # read-only, moved or deleted
            _internal_error(name, e)
        if _traceback_wanted():
            traceback.print_exception(e)
        print(f"molt {name}: cannot go on: {f'{e.filename}: ' if e.filename else ''}{e.strerror}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:
        _internal_error(name, e)
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)


if __name__ == "__main__":  # `python -m molt.cli.main`: run the imported module, whose state the commands share
    from molt.cli.main import main as imported

    imported()
