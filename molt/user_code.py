"""User code imported by path or name: agent and reward files, and `algo.plugins` (your own algorithm variants).

`import_user_module` imports `file.py` as `python file.py` would see it (its folder first on sys.path) or a dotted
module; `import_failure` says where an import raised. Imports nothing of Molt, so the config may use it."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

_FOLDERS: set[Path] = set()  # the folders of the user files imported so far
_ALIASED: dict[str, Path] = {}  # plain module name -> the user file `import_user_module` also registered under it


def import_failure(spec: str, error: Exception) -> str:
    """`importing SPEC failed at FILE:LINE: Type: message`: where in the user's file its import raised (a syntax
    error's own line), else the spec's file."""
    where, text = spec.split(":")[0], str(error)
    file = Path(where).resolve()
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        where, text = f"{error.filename}:{error.lineno}", error.msg
    elif frames := [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == file]:
        where = f"{frames[-1].filename}:{frames[-1].lineno}"
    return f"importing {spec!r} failed at {where}: {type(error).__name__}: {text}"


def import_user_module(target: str):
    """The module of `file.py`, its folder first on sys.path (as `python file.py` has it: it imports the modules
    beside it), or of a dotted name, found in the current folder too (as `python -m` has it). An ImportError when
    the file uses a module that another user file's folder gave first, while its own folder holds one of that name:
    a process imports a name once, so it would silently get the other one. A file this process imported already (as
    a plugin, an agent, a reward, or with `import`) is that module, unless it was imported here and has been edited
    since: its code runs once per version (an agent file edited in a notebook runs anew)."""
    if target.endswith(".py"):
        path = Path(target)
        version = path.stat().st_mtime
        if (module := _imported(path.resolve(), version)) is not None:
            return module
        if (folder := path.resolve().parent) not in _FOLDERS:
            _FOLDERS.add(folder)
            sys.path.insert(0, str(folder))
        _check_siblings(path, folder)
        module_spec = importlib.util.spec_from_file_location(f"molt_agent_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        # also its plain name while free (or this file's older version): a reward's `import my_env`, directly or
        # through a helper, is the agent file's module, one module state for both, not a second copy of the file
        held = sys.modules.get(path.stem)
        plain = path.stem.isidentifier() and (held is None or _ALIASED.get(path.stem) == path.resolve())
        names = [module_spec.name, *([path.stem] if plain else [])]
        sys.modules.update(dict.fromkeys(names, module))
        _ALIASED.update(dict.fromkeys(names[1:], path.resolve()))
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            for name in names:  # half run: not a module to hand out again
                del sys.modules[name]
                _ALIASED.pop(name, None)
            raise
        _VERSIONS[path.resolve()] = version
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # last: an installed package of the same name still wins
    return importlib.import_module(target)


def _check_siblings(path: Path, folder: Path) -> None:
    """An ImportError when user file `path` imports a module name that an earlier user file's folder gave the
    process, while `folder` holds its own of that name. A plain name only aliased to an earlier user file (see
    `import_user_module`) is dropped instead: the file beside this one is its module."""
    tree = ast.parse(path.read_bytes(), str(path))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    for name in sorted({n.partition(".")[0] for n in names} & _ALIASED.keys()):
        own, held = folder / f"{name}.py", getattr(sys.modules.get(name), "__file__", None)
        if own.is_file() and own.resolve() != _ALIASED[name]:
            aliased = _ALIASED.pop(name)
            if held is not None and Path(held).resolve() == aliased:  # still that alias (not replaced since)
                del sys.modules[name]
    for name in sorted({n.partition(".")[0] for n in names} & set(sys.modules)):
        there = Path(getattr(sys.modules[name], "__file__", None) or "").resolve()
        other = there.parent.parent if there.name == "__init__.py" else there.parent
        mine = folder / f"{name}.py" if (folder / f"{name}.py").exists() else folder / name / "__init__.py"
        if other in _FOLDERS - {folder} and mine.exists():
            raise ImportError(f"{path} imports {name!r}, which this process already took from {there} for an earlier "
                              f"user file, not {mine} beside it: rename one of the two modules")  # fmt: skip


_VERSIONS: dict[Path, float] = {}  # the modification time of each file `import_user_module` ran


def _imported(path: Path, version: float):
    """The module this process imported from file `path` (as it is now, if imported here), or None."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(path.name) and Path(file).resolve() == path:
            return module if _VERSIONS.get(path, version) == version else None
    return None


_FAILED: dict[str, BaseException] = {}  # `import_once`'s failures, by resolved file path or module name


def import_once(target: str):
    """`import_user_module(target)`, and the same error again for a target that failed in this process (a plugin
    that registered some variants before it raised would otherwise fail again on those, hiding its error)."""
    key = str(Path(target).resolve()) if target.endswith(".py") else target
    if key in _FAILED:
        raise _FAILED[key]
    try:
        return import_user_module(target)
    except Exception as e:
        _FAILED[key] = e
        raise
