"""TOML / YAML config files -> the typed config tree, strictly.

Unknown keys, wrong types and invalid values are errors naming the dotted key, the file and (where
the format lets us find it) the line. Values are checked against the dataclass field types; nothing
is silently converted except int -> float, a path -> str and numpy-style numbers -> int / float."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import numbers
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from molt.config import ConfigError, check


def _toml_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line for a TOML document (tables and dotted keys)."""
    where, table = {}, ""
    for lineno, line in enumerate(text.splitlines(), 1):
        if m := re.match(r"\s*\[([^\[\]]+)\]\s*(#.*)?$", line):
            table = m[1].strip().replace(" ", "")
            where.setdefault(table, lineno)
        elif m := re.match(r"\s*([A-Za-z0-9_.\-\"' ]+?)\s*=", line):
            key = m[1].replace('"', "").replace("'", "").replace(" ", "")
            where.setdefault(f"{table}.{key}" if table else key, lineno)
    return where


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats (`5e-4` and `1E3` are numbers, not the strings YAML 1.1 reads),
    refusing a key repeated in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _yaml_lines(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    where = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            where[key] = key_node.start_mark.line + 1
            where |= _yaml_lines(value_node, key + ".")
    return where


def nested(*sources: dict[str, Any]) -> dict[str, Any]:
    """`{"train.lr": 1e-4, "eval": {"every": 0}}` -> `{"train": {"lr": 1e-4}, "eval": {"every": 0}}`; later
    sources override earlier ones key by key."""
    out: dict[str, Any] = {}
    for key, value in (item for source in sources for item in source.items()):
        *groups, name = str(key).split(".")
        node = out
        for group in groups:
            node = node.setdefault(group, {})
            check(isinstance(node, dict), group, f"a config group (a dict of its keys), got {type(node).__name__} "
                  f"{node!r}")  # fmt: skip
        if isinstance(value, dict) and isinstance(node.get(name), dict):
            node[name].update(nested(value))
        else:
            node[name] = nested(value) if isinstance(value, dict) else value
    return out


def _undot(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A YAML file's dotted keys (`train.lr: 5e-4`) nested as TOML nests them; a key also set in its group is an
    error (YAML refuses a key set twice)."""
    for key in (k for k in data if "." in str(k)):
        group, name = str(key).split(".", 1)
        twice = group in data and (not isinstance(data[group], dict) or name.split(".")[0] in data[group])
        check(not twice, f"{path}: {key}", "set twice (in its group and as a dotted key)")
    return nested(data)


def read_file(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """(mapping, dotted key -> line) of a .toml / .yaml / .yml file."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder; give its .toml/.yaml file (a run's: config.yaml)" if path.is_dir() else "does not exist"
        raise ConfigError(f"--config: {str(path)!r} {what}")
    try:
        text, suffix = path.read_text(encoding="utf-8-sig"), path.suffix.lower()  # a BOM (Windows editors) is no key
        if suffix == ".toml":
            return tomllib.loads(text), _toml_lines(text)
        if suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_Yaml12Loader) or {}  # noqa: S506 - a safe loader subclass
            check(isinstance(data, dict), str(path), "top level must be a mapping of config groups")
            return _undot(data, path), _yaml_lines(yaml.compose(text, Loader=_Yaml12Loader))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: cannot parse: {getattr(e, 'problem', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from None
    raise ConfigError(f"--config: {path} must end in .toml, .yaml or .yml")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` checked against type `tp` (any integer for int, any real for float, a path for str; lists for tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for option in args:  # none fits: the error at the end names the whole union
            with contextlib.suppress(ConfigError):
                return coerce(value, option, key)
    elif origin is typing.Literal:
        check(value in args, key, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple) and isinstance(value, list | tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            check(len(value) == len(args), key, f"expected {len(args)} values, got {len(value)}")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
        return origin(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    number = numbers.Integral if tp is int else numbers.Real if tp is float else None  # numpy scalars too, no bool
    if number and isinstance(value, number) and not isinstance(value, bool):
        return tp(value)
    if tp is str and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    code = callable(value) and key in ("rollout.reward", "rollout.agent")  # a name to import, not the object
    hint = "; pass '__main__:NAME' for a function or class defined in your script" if code else ""
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}{hint}")


def build(cls: type, data: dict[str, Any], base: Any = None, prefix: str = "", skip: frozenset[str] = frozenset()):
    """Instance of dataclass `cls` from nested `data`, starting from `base` (or the defaults); the dotted keys and
    groups in `skip` (set again by flags, or not read by the command) are left out, so their file values are neither
    used nor checked."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if prefix or f.name != "config"]  # the root's: --config's value
    values = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted == "config":  # older runs' config.yaml hold it empty: it names nothing
            check(value == "", "config",
                  "a config cannot name another config; pass the file to molt.train(path) / --config")  # fmt: skip
            continue
        _known(key, names, prefix)
        tp = hints[key]
        if dotted in skip:  # not read; still a key of the config (a typo there is one everywhere)
            if dataclasses.is_dataclass(tp) and isinstance(value, dict):
                sub = [f.name for f in dataclasses.fields(tp)]
                for inner in value:
                    _known(inner, sub, f"{dotted}.")
            continue
        if dataclasses.is_dataclass(tp):
            check(isinstance(value, dict), dotted, f"expected a table of {tp.__name__} fields, got {value!r}")
            values[key] = build(tp, value, getattr(base, key, None), f"{dotted}.", skip)
        else:
            values[key] = coerce(value, tp, dotted)
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def _known(key: str, names: list[str], prefix: str) -> None:
    """A ConfigError for a key that is none of `names` (a group's fields), with the closest as a hint."""
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys: {names}"
        raise ConfigError(f"{prefix}{key}: unknown key{hint}")


def load_config_file(
    cls: type, path: str | Path, base: Any = None, skip: frozenset[str] = frozenset(), overrides: dict | None = None
) -> Any:
    """`build` of file `path`'s values but the keys in `skip`, then `overrides` (checked together: a file's model
    folder another replaces need not exist); its errors name file, line and key."""
    data, lines = read_file(path)
    given = nested(overrides or {})
    try:
        return build(cls, nested(data, given), base, skip=skip)
    except ConfigError as e:
        key = re.sub(r"(\[\d+\])+$", "", str(e).split(":", 1)[0])  # a tuple entry's line is its key's
        group, _, name = key.partition(".")
        if isinstance(given.get(group), dict) and name in given[group]:  # an override's, not the file's
            raise
        line = lines.get(key) or lines.get(key.rsplit(".", 1)[0])
        error = ConfigError(f"{path}{f':{line}' if line else ''}: {e}")
        error.key = key
        raise error from None
