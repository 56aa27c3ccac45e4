"""The import graph of gputq's own modules: layers point downwards, and no cycle exists; and no module
reads another object's private attributes.

The graph is read from the source with ``ast`` (nothing is imported), with
``transport/`` and ``kernels/`` named as they install: ``gputq.transport``
and ``gputq.kernels``. Each module belongs to one layer (its room); an
import may reach its own layer or one below. A gputq module is never
imported inside a function: only optional dependencies (Ray, torch, CuPy,
NIXL, prometheus_client) load lazily, so the module graph is the whole
truth about what depends on what.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

import gputq

ROOT = Path(__file__).resolve().parents[1]

#: Bottom to top. A module's layer is the longest prefix of its name listed here.
LAYERS = (
    "gputq.errors",
    "gputq.transport",
    "gputq.kernels",
    "gputq.data",
    "gputq.config",
    "gputq.unit",
    "gputq.client",
    "gputq.cluster",
    "gputq.integrations",
    "gputq.tools",
    "gputq",
)
#: Where each import name's source lives in the repository.
SOURCES = {"gputq": ROOT / "gputq", "gputq.transport": ROOT / "transport", "gputq.kernels": ROOT / "kernels"}
#: What the lower layers may import of the rest of gputq besides themselves.
LOWER_LAYERS_MAY_IMPORT = {"gputq.transport": {"gputq.errors"},
                           "gputq.kernels": {"gputq.errors", "gputq.transport"}}


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if prefix == "gputq" and parts[0] in ("transport", "kernels"):
                continue  # not there in a checkout; named for completeness
            name = ".".join((prefix, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> str:
    return max((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), key=len)


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported gputq module, line, inside a function) for every import statement of ``module``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module
                # ``from gputq import transport`` imports the module gputq.transport, not the package.
                names = [f"{source}.{alias.name}" for alias in child.names if f"{source}.{alias.name}" in MODULES]
                found.extend((target, child.lineno, in_function) for target in names or [source])
            visit(child, nested)

    visit(ast.parse(path.read_text(), str(path)), False)
    return [(target, line, inner) for target, line, inner in found if target.split(".")[0] == "gputq"]


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_module_has_a_layer_and_the_graph_is_not_empty():
    assert len(MODULES) > 50 and sum(map(len, GRAPH.values())) > 100
    assert {"gputq.transport.tcp", "gputq.kernels.plan", "gputq.client.reader", "gputq.tools.cli"} <= set(MODULES)
    top_level = sorted(m for m in MODULES if m.count(".") == 1 and layer_of(m) == "gputq")
    assert top_level == [], f"modules outside every room: {top_level}"


def test_imports_point_down_a_layer_or_stay_in_their_own():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [f"{module}:{line} imports {target} ({layer_of(module)} -> {layer_of(target)})"
              for module, imports in GRAPH.items() for target, line, _ in imports
              if rank[layer_of(target)] > rank[layer_of(module)]]
    assert upward == []


def test_no_gputq_module_is_imported_inside_a_function():
    lazy = [f"{module}:{line} imports {target}" for module, imports in GRAPH.items()
            for target, line, inner in imports if inner]
    assert lazy == []


def test_lower_layers_import_nothing_of_gputq_but_the_error_tree():
    wrong = []
    for module, imports in GRAPH.items():
        allowed = LOWER_LAYERS_MAY_IMPORT.get(layer_of(module))
        if allowed is None:
            continue
        for target, line, _ in imports:
            if layer_of(target) != layer_of(module) and layer_of(target) not in allowed:
                wrong.append(f"{module}:{line} imports {target}")
    assert wrong == []


def test_the_import_graph_has_no_cycle():
    edges = {module: sorted({target for target, _, _ in imports if target in MODULES and target != module})
             for module, imports in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in edges[module]:
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                walk(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            walk(module, [module])
    assert cycles == []


@pytest.mark.parametrize("folder", ["gputq", "transport", "kernels", "tests", "bench", "scripts"])
def test_nothing_imports_the_lower_layers_by_a_top_level_name(folder):
    """``transport`` and ``kernels`` are import names of other packages; gputq's are under ``gputq.``."""
    stray = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            stray += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in ("transport", "kernels")]
    assert stray == []


def test_errors_are_defined_in_one_module():
    """Every public exception class of gputq derives from GputqError and lives in gputq.errors."""
    elsewhere = []
    for module, path in MODULES.items():
        if module == "gputq.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    isinstance(base, ast.Name) and (base.id.endswith("Error") or base.id == "Exception")
                    for base in node.bases):
                elsewhere.append(f"{module}.{node.name}")
    assert elsewhere == []
    tree = set(gputq.errors.__all__)
    assert {"GputqError", "PlanError", "UnitLostError", "StaleReadError"} <= tree
    assert all(issubclass(getattr(gputq.errors, name), gputq.errors.GputqError) for name in tree)


def test_the_package_exports_every_name_it_lists():
    """The lazily loaded names resolve, to the object their home module defines."""
    for name in gputq.__all__:
        assert getattr(gputq, name) is not None, name
    assert set(gputq.errors.__all__) <= set(gputq.__all__)
    assert gputq.Reader.__module__ == "gputq.client.reader"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        getattr(gputq, "Nope")


def _defines_private(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions and classes, and the attributes its classes set."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else \
                    [item.target] if isinstance(item, ast.AnnAssign) else []
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {name for name in names if name.startswith("_")}


def private_reaches(source: str, where: str = "<source>") -> list[str]:
    """Reads of another object's private attribute: ``x._name`` where ``x`` is not ``self`` or ``cls``
    and no class of the same module defines ``_name`` (a module's classes may share their privates)."""
    tree = ast.parse(source, where)
    own = _defines_private(tree)
    return [f"{where}:{node.lineno} {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) and node.attr not in own]


def test_the_private_attribute_rule_catches_a_reach_into_another_object():
    assert private_reaches("class S:\n    def f(self):\n        return self._reader._clients\n") == \
        ["<source>:3 self._reader._clients"]
    assert private_reaches("def f(reader):\n    return reader._device\n") == ["<source>:2 reader._device"]
    # Its own objects' privates, set by a class of the same module, are the module's to read.
    assert private_reaches("class A:\n    def __init__(self):\n        self._x = 1\n"
                           "class B:\n    def f(self, a):\n        return a._x, a.__class__\n") == []


def test_no_module_reads_a_private_attribute_of_an_object_it_does_not_own():
    """A stage gets what it needs through a narrow context, never another object's privates."""
    reaches = [hit for module, path in MODULES.items() for hit in private_reaches(path.read_text(), module)]
    assert reaches == []


def test_no_function_of_the_client_room_is_over_60_lines():
    """One job a function: the read and write paths are stages of small functions (docstrings count)."""
    long = [f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for module, path in MODULES.items() if module.startswith("gputq.client")
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert long == []


#: A figure of this machine's in prose: "20 us", "0.7 GB/s", "2.5x faster", "the dev box".
_TIMING = re.compile(r"\d[\d.,]* ?(?:us|µs|ms|GB/s|MB/s|GiB/s)\b|\d[\d.]*x (?:faster|slower|as fast)|dev box")


def test_no_comment_or_docstring_quotes_a_timing():
    """Timings go stale with every change: the code says why, docs/PERFORMANCE.md says how fast."""
    quoted = [f"{module}:{i}: {line.strip()}" for module, path in MODULES.items()
              for i, line in enumerate(path.read_text().splitlines(), 1)
              if _TIMING.search(line) and "DEFAULT_CALIBRATION" not in line and "source=" not in line]
    assert quoted == []


@pytest.mark.parametrize("folder", ["gputq", "transport", "kernels", "tests", "bench", "scripts"])
def test_every_source_compiles_without_a_warning(folder):
    """An invalid escape in a string is a warning from 3.12 on, printed to the user's stderr (a CLI's one-line
    error then is three) whenever the module is compiled; earlier Pythons hide it."""
    warned = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(), str(path), "exec")
            except SyntaxError as exc:
                warned.append(f"{path.relative_to(ROOT)}:{exc.lineno}: {exc.msg}")
    assert warned == []
