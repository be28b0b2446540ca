"""DESIGN.md's import rules, checked over the package's real imports (module-level and inside functions).

Stages are `molt.<stage>`; `molt.errors`, `molt.registry`, `molt.threads` and `molt.user_code` import nothing and
may be imported by any stage, like the root package (`molt.cache_root`; its `train()` facade is exempt from the
rules: it is the API over the commands). The rules: algo imports only torch; models nothing above them; engine only
models; agents not train (nor the loop, runtime or CLI); config nothing above itself; no import cycles between
modules (through imports outside functions; those inside a function run late and are checked by the rules).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "molt"
FOUNDATION = {
    "molt",
    "errors",
    "registry",
    "threads",
    "user_code",
}  # import nothing of Molt's stages; anyone may import them
ONLY = {  # stage -> the only other stages it may import (besides FOUNDATION)
    "algo": set(),
    "models": set(),
    "engine": {"models"},
    "config": {"models", "algo", "data"},
}
NEVER = {"agents": {"train", "loop", "runtime", "cli"}}  # stage -> stages it must not import
KNOWN_CYCLES: list[set[str]] = []  # none: a cycle is a breach (compiled.py <-> runner.py was one, now untangled)

Graph = dict[str, dict[str, bool]]  # module -> {imported molt module: imported at module level}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.Module, known: set[str]) -> dict[str, bool]:
    """The Molt modules a module's source imports, each with whether any import of it is at module level (outside
    functions: also under `if TYPE_CHECKING`, a static dependency all the same)."""
    in_functions = {
        id(inner)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(fn)
    }
    found: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:  # a submodule, or the module
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        else:
            continue
        for name in (n for n in names if n in known):
            found[name] = found.get(name, False) or id(node) not in in_functions
    return found


def import_graph(root: Path = PACKAGE) -> Graph:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    return {m: imports_of(ast.parse(p.read_text()), set(paths)) for m, p in paths.items()}


def stage(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def breaches(graph: Graph) -> list[str]:
    """Every import that breaks a stage rule, as `importer -> imported (rule)`."""
    out = []
    for importer, imported in graph.items():
        if "." not in importer:
            continue  # the root package's facade
        src = stage(importer)
        for target in imported:
            dst = stage(target)
            if dst == src or dst in FOUNDATION:
                continue
            if src in FOUNDATION and src != "molt":
                out.append(f"{importer} -> {target} (foundation modules import nothing of Molt)")
            elif src in ONLY and dst not in ONLY[src]:
                out.append(f"{importer} -> {target} ({src} may import only {sorted(ONLY[src]) or 'torch'})")
            elif dst in NEVER.get(src, ()):
                out.append(f"{importer} -> {target} ({src} must not import {dst})")
    return sorted(out)


def cycles(graph: Graph) -> list[set[str]]:
    """Strongly connected groups (> 1 module) of the module-level import graph (Tarjan; the root facade's
    type-only import of the train command is no edge: `import molt` never runs it)."""
    edges = {m: [t for t, top in imported.items() if top and t in graph and "." in m] for m, imported in graph.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(group)

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_package_keeps_the_layer_rules():
    assert breaches(import_graph()) == []


def test_the_package_has_no_import_cycles_but_the_known_one():
    found = cycles(import_graph())
    assert [c for c in found if c not in KNOWN_CYCLES] == []


def test_a_planted_breach_and_cycle_are_caught():
    clean: Graph = {
        "molt.errors": {},
        "molt.models.transformer": {"molt.errors": True},
        "molt.algo.kl": {},
        "molt.engine.core": {"molt.models.transformer": True},
        "molt.train.trainer": {"molt.algo.kl": True, "molt.models.transformer": True},
        "molt.agents.runner": {"molt.engine.core": True},
        "molt.config": {"molt.models.transformer": False},
    }
    assert breaches(clean) == [] and cycles(clean) == []
    planted = {m: dict(imported) for m, imported in clean.items()}
    planted["molt.algo.kl"]["molt.train.trainer"] = False  # algo reaching into train (even lazily)
    planted["molt.models.transformer"]["molt.engine.core"] = True  # models above themselves, and a cycle
    planted["molt.agents.runner"]["molt.train.trainer"] = False
    planted["molt.config"]["molt.agents.runner"] = False
    assert breaches(planted) == [
        "molt.agents.runner -> molt.train.trainer (agents must not import train)",
        "molt.algo.kl -> molt.train.trainer (algo may import only torch)",
        "molt.config -> molt.agents.runner (config may import only ['algo', 'data', 'models'])",
        "molt.models.transformer -> molt.engine.core (models may import only torch)",
    ]
    assert cycles(planted) == [{"molt.models.transformer", "molt.engine.core"}]


def test_module_imports_are_read_from_source(tmp_path):
    pkg = tmp_path / "molt"
    (pkg / "algo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "algo" / "__init__.py").write_text("")
    (pkg / "algo" / "kl.py").write_text("import torch\n\n\ndef f():\n    from molt.train import trainer\n")
    (pkg / "train").mkdir()
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "trainer.py").write_text("from molt.algo.kl import f\n")
    graph = import_graph(pkg)
    assert graph["molt.algo.kl"] == {"molt.train.trainer": False}
    assert graph["molt.train.trainer"] == {"molt.algo.kl": True}
    assert breaches(graph) == ["molt.algo.kl -> molt.train.trainer (algo may import only torch)"]
