"""The layout's rules (docs/layout.md), read from the source with `ast`, so a change that
breaks one fails here: dependencies point one way, no import cycles, no package deeper than
two levels, tests mirror the source tree and never import each other."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("backoff_core", "deployments", "clients")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of the file (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _source_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "_pb2" not in p.name)


def _is_module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _unit(module: str) -> str:
    """The package a module belongs to (`backoff_core.engine`, `deployments.serving`, ...);
    top-level modules of backoff_core (types, sampling) are units of their own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in _source_files(package):
            source = _module_name(path)
            for target in _imports(path):
                if target.split(".")[0] in PACKAGES and _is_module(target) and target != source:
                    edges[source].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_between_modules_or_packages():
    edges = _graph()
    assert _cycles(edges) == []
    units: dict[str, set[str]] = defaultdict(set)
    for source, targets in edges.items():
        units[_unit(source)].update(_unit(t) for t in targets if _unit(t) != _unit(source))
    assert _cycles(units) == []


@pytest.mark.parametrize(
    "package, banned",
    [
        ("backoff_core", ("ray", "deployments", "clients", "fastapi", "grpc")),
        ("clients", ("ray", "torch", "backoff_core", "deployments")),
        ("deployments/serving", ("ray",)),
    ],
)
def test_dependencies_point_one_way(package, banned):
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _source_files(package)
        for name in _imports(path)
        if name.split(".")[0] in banned
    ]
    assert offenders == []


def test_no_package_deeper_than_two_levels():
    deep = [
        p for package in PACKAGES for p in (ROOT / package).rglob("__init__.py") if len(p.relative_to(ROOT).parts) > 3
    ]
    assert deep == []


def test_test_directories_mirror_the_source_tree():
    for init in (ROOT / "tests").rglob("__init__.py"):
        folder = init.parent.relative_to(ROOT / "tests")
        if folder.parts and folder.parts[0] != "support":
            assert (ROOT / folder).is_dir(), f"tests/{folder} mirrors no source folder"


def test_no_test_module_imports_another():
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        for name in _imports(path):
            if name.startswith("tests.") and "support" not in name.split(".")[:2]:
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


@pytest.mark.parametrize("module", ["deployments.ingress", "deployments.app"])
def test_the_ingress_and_the_app_builder_load_no_model_stack(module):
    """The Ingress replica maps records and errors, it runs no model; Serve's app builder
    (deployments.app, imported in a fresh process at every deploy) needs only the classes.
    Importing either loads neither torch nor transformers (7 s of a replica's start on a
    2-core machine, 1.7 s without; the builder 6.6 CPU-s, 1.8 without), so every served app
    starts faster. A new import of the engine, a runner or a router at module level in their
    graph (deployments/small.py, large.py and what they import) fails here, naming it."""
    import subprocess
    import sys

    probe = f"import sys, {module}; print(*sorted({{m.split('.')[0] for m in sys.modules}}))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert {"torch", "transformers"}.isdisjoint(loaded.stdout.split()), loaded.stdout


# STYLE.md 5: a module that passes ~400 lines is split at a natural seam (ingress.py ->
# ingress_grpc.py, formats.py -> sse.py, engine.py -> lifecycle.py, types.py -> results.py,
# serve_cli.py -> ray_env.py); generated protobuf stubs aside
SIZED = (*PACKAGES, "scripts", "benchmarks", "tests/support")
MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in SIZED
        for path in _source_files(folder)
    }
    assert len(sizes) > 100 and "backoff_core/engine/engine.py" in sizes  # the walk found the tree
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def _methods(path: Path, cls: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse((ROOT / path).read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls).body
    return {node.name: node for node in body if isinstance(node, ast.FunctionDef)}


def test_each_step_function_is_one_screen_and_the_plain_one_checks_no_mode():
    """One step function per mode (STYLE.md 2), each at most 25 lines over the stages'
    helpers: the functions settings.py binds, every one of them; the plain step names
    neither mode (`ahead`, `flights`)."""
    bind = _methods("backoff_core/engine/settings.py", "LiveSettings")["_bind_step"]
    # `self._step_fn = engine._step_plain`: the class's functions it assigns
    bound = {n.value.attr for n in ast.walk(bind) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute)}
    assert bound == {"_step_plain", "_step_in_flight", "_step_ahead"}
    steps = {
        name: fn for name, fn in _methods("backoff_core/engine/engine.py", "BackoffEngine").items() if name in bound
    }
    assert set(steps) == bound
    lengths = {name: fn.end_lineno - fn.lineno + 1 for name, fn in steps.items()}
    assert all(n <= 25 for n in lengths.values()), lengths
    names = {n.attr for n in ast.walk(steps["_step_plain"]) if isinstance(n, ast.Attribute)}
    assert names.isdisjoint({"ahead", "flights"})
