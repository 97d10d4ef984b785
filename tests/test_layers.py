"""Every import of the project's packages points one way (DESIGN.md, "Components and where they live"):

    the algorithm core (`rollverify` outside `rollverify.app`)   imports only the core
    the wings (`sglang_ext`, `megatron_bridge`)                  import the core and themselves, never each other
    the application (`rollverify.app`)                           imports anything

Every import statement of every module counts, wherever it stands (top of the file, inside a function, under
`if TYPE_CHECKING:`), relative ones resolved, and `importlib.import_module("...")` with a literal name. The
module graph (the same imports) has no cycle.

`python tests/test_layers.py [ROOT]` prints the arrows against the directions and the cycles of a tree (any
checkout, e.g. an older commit's) without failing.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollverify", "sglang_ext", "megatron_bridge")
APP = "rollverify.app"
WINGS = ("sglang_ext", "megatron_bridge")
SKIP = ("sglang_ext/cpu_compat/shim",)  # stand-ins for SGLang's own modules, not the project's


@dataclass(frozen=True)
class Arrow:
    """`importer` (a module) imports `target` (a module) at `path`:`line`."""

    importer: str
    target: str
    path: str
    line: int
    typing_only: bool = False  # under `if TYPE_CHECKING:` (never runs, so no part of a cycle)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} -> {self.target}"


def layer(module: str, app: tuple[str, ...] = (APP,)) -> str:
    """The layer of a project module: core, app, or the wing's package name. `app`: the application's modules
    and packages (another tree's, to measure it)."""
    top = module.split(".")[0]
    if top in WINGS:
        return top
    return "app" if any(module == a or module.startswith(a + ".") for a in app) else "core"


def allowed(importer: str, target: str, app: tuple[str, ...] = (APP,)) -> bool:
    src, dst = layer(importer, app), layer(target, app)
    if src == "app" or dst == "core":
        return True
    return src == dst  # a wing imports itself; the core imports neither wing nor the app


def modules(root: Path) -> dict[str, Path]:
    """Every project module under `root`, by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            if any(rel.as_posix().startswith(s) for s in SKIP):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module `name` names (a module, or an attribute of its longest module prefix)."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in known:
            return prefix
    return None


def imports(module: str, path: Path, known: dict[str, Path], root: Path) -> list[Arrow]:
    """Every import of a project module in `path`, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    rel = path.relative_to(root).as_posix()
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    names: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        hint = id(node) in typing_only
        if isinstance(node, ast.Import):
            names += [(a.name, node.lineno, hint) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names += [(f"{stem}.{a.name}", node.lineno, hint) for a in node.names]
            names.append((stem, node.lineno, hint))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append((node.args[0].value, node.lineno, hint))
    arrows = {}
    for name, line, hint in names:
        target = _resolve(name, known)
        if target is not None and target != module:
            arrows[(target, line)] = Arrow(module, target, rel, line, hint)
    return sorted(arrows.values(), key=lambda a: (a.line, a.target))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph(root: Path) -> list[Arrow]:
    known = modules(root)
    return [a for m, p in known.items() for a in imports(m, p, known, root)]


def wrong_way(root: Path, app: tuple[str, ...] = (APP,)) -> list[Arrow]:
    return [a for a in graph(root) if not allowed(a.importer, a.target, app)]


def cycles(root: Path) -> list[list[str]]:
    """The module graph's strongly connected components of more than one module (Tarjan), each sorted; imports
    that only type checkers run are left out. A package's `__init__` importing its own submodules counts like any
    other import."""
    edges: dict[str, set[str]] = {}
    for a in graph(root):
        if a.typing_only:
            continue
        edges.setdefault(a.importer, set()).add(a.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


# ---------------------------------------------------------------------------------------------------- tests


def test_every_import_points_down_the_layers():
    bad = wrong_way(ROOT)
    assert not bad, f"{len(bad)} import(s) against the layers:\n" + "\n".join(map(str, bad))


def test_no_import_cycle():
    found = cycles(ROOT)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_tools_never_import_tests_and_tests_share_helpers_not_test_modules():
    """What tests share lives in helper modules (tests/fakes.py, engine_fixtures.py, e2e_checks.py, ...), never in
    a test module another imports; tools stand on the package alone (a test may import a tool it tests)."""
    test_modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    bad = []
    for folder in ("tests", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    top = name.split(".")[0]
                    if top in test_modules or (top == "tests" and folder == "tests" and "test_" in name):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports the test module {name}")
                    elif folder == "tools" and (top == "tests" or (ROOT / "tests" / f"{top}.py").is_file()):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: a tool imports tests' {name}")
            if folder == "tools" and ('"tests"' in path.read_text() or "'tests'" in path.read_text()):
                bad.append(f"{path.relative_to(ROOT)}: a tool puts tests/ on its import path")
    assert not bad, "\n".join(bad)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


def test_the_check_catches_each_kind_of_wrong_way_import(tmp_path):
    """Planted imports against the directions, one of each form, are each found at their file and line; the
    allowed ones are not."""
    root = _tree(tmp_path, {
        "rollverify/types.py": "X = 1\n",
        "rollverify/app/__init__.py": "",
        "rollverify/app/run.py": "import sglang_ext.client\nimport megatron_bridge.trainer\nfrom rollverify import loop\n",
        "rollverify/loop.py": (
            "from rollverify.types import X\n"
            "def f():\n"
            "    from rollverify.app import run\n"  # core -> app, lazily
            "    return run\n"
        ),
        "rollverify/strategies.py": "from .app.run import main\n",  # core -> app, relative
        "rollverify/verify.py": "import importlib\nm = importlib.import_module('sglang_ext.client')\n",
        "sglang_ext/client.py": "from rollverify.types import X\nfrom . import pool\n",
        "sglang_ext/pool.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_bridge import trainer\n",
        "sglang_ext/server.py": "from sglang_ext import handlers\n",
        "sglang_ext/handlers.py": "import typing\nif typing.TYPE_CHECKING:\n    from sglang_ext.server import S\n",
        "megatron_bridge/trainer.py": "import rollverify.app.run as r\n",  # wing -> app
    })
    found = {(a.path, a.line, a.target) for a in wrong_way(root)}
    assert found == {
        ("rollverify/loop.py", 3, "rollverify.app"),
        ("rollverify/loop.py", 3, "rollverify.app.run"),
        ("rollverify/strategies.py", 1, "rollverify.app.run"),
        ("rollverify/verify.py", 2, "sglang_ext.client"),
        ("sglang_ext/pool.py", 3, "megatron_bridge"),
        ("sglang_ext/pool.py", 3, "megatron_bridge.trainer"),
        ("megatron_bridge/trainer.py", 1, "rollverify.app.run"),
    }
    # run -> loop -> run and run -> trainer -> run; server <-> handlers is for type checkers only
    assert cycles(root) == [["megatron_bridge.trainer", "rollverify.app.run", "rollverify.loop"]]


if __name__ == "__main__":
    tree = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    # a tree from before rollverify.app: the application's modules named by hand, comma-separated
    app = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else (APP,)
    bad = wrong_way(tree, app)
    print("\n".join(f"{a} ({layer(a.importer, app)} -> {layer(a.target, app)})" for a in bad))
    pairs = {(a.importer, a.target) for a in bad}
    print(f"{len(bad)} import statement(s) against the layers, {len(pairs)} module arrow(s)")
    for c in cycles(tree):
        print(f"cycle of {len(c)}: {' '.join(c)}")
