"""The shape of the code base, checked: the client's modules form a DAG (function-local
imports included), workers import only the shared protocol modules, no module imports
another's private names, and no module outgrows the size budget."""

from __future__ import annotations

import ast
import os

from paths import REPO

ROOT = os.path.join(REPO, "tdmesh")
# The layers, bottom first: a module may import its own layer and the layers below, never one
# above (function-local imports included).  The public modules are the top-level ones.
LAYERS = ["base", "geometry", "protocol", "engine", "programs", "fleet", "monitor", "api", "builtins", "interop",
          "root"]
# the subpackages of those layers: api is the public top-level modules, root the package's __init__ alone
# (it re-exports every layer, and imports interop, which adapts torch's ecosystem with the api's functions);
# builtins: Monarch's builtins under their Monarch names, made of the api's functions
PACKAGES = ["geometry", "protocol", "engine", "programs", "fleet", "monitor", "builtins", "interop"]
BASE = {"tdmesh.errors", "tdmesh.config", "tdmesh.garbage"}  # everyone's: the error types, the one table
# of settings, and how both kinds of process tune Python's garbage collector
# The workers stand beside the engine, on what crosses the wire: nothing of the client's side.
WORKER_MAY_IMPORT = {"base", "geometry", "protocol", "worker"}
MAX_LINES = 400


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(module: str, path: str) -> list[tuple[str, list[str]]]:
    """(imported tdmesh module, names imported from it) for every import in the file."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("tdmesh")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("tdmesh"):
                continue
            names = [a.name for a in node.names]
            submodules = [n for n in names if f"{target}.{n}" in MODULES]  # `from . import messages`
            out += [(f"{target}.{n}", []) for n in submodules]
            if len(submodules) < len(names):
                out.append((target, [n for n in names if n not in submodules]))
    return out


GRAPH = {mod: _imports(mod, path) for mod, path in MODULES.items()}


def layer(module: str) -> str:
    """The layer of a tdmesh module: its subpackage, the base, or the public top level."""
    if module in BASE:
        return "base"
    if module == "tdmesh":
        return "root"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS + ["worker"]:
        return parts[1]
    return "api"


def test_every_import_runs_down_the_layers():
    bad = []
    for m, deps in GRAPH.items():
        mine = layer(m)
        for t, _ in deps:
            theirs = layer(t)
            if mine == "worker" or theirs == "worker":  # the client's side never imports a worker module
                allowed = mine == "worker" and theirs in WORKER_MAY_IMPORT
            else:
                allowed = LAYERS.index(theirs) <= LAYERS.index(mine)
            if not allowed:
                bad.append(f"{m} ({mine}) imports {t} ({theirs})")
    assert not bad, "\n".join(bad)


def test_each_layer_is_a_package_and_every_module_has_one():
    """The table above is the layout: each layer but the base, the public modules and the root is a subpackage."""
    for name in PACKAGES:
        assert os.path.isfile(os.path.join(ROOT, name, "__init__.py")), name
    stray = [m for m in MODULES if m.count(".") > 1 and m.split(".")[1] not in LAYERS + ["worker"]]
    assert not stray, stray


def test_client_modules_form_a_dag():
    edges = {m: {t for t, _ in deps if t in MODULES and t != "tdmesh" and t != m}
             for m, deps in GRAPH.items() if m != "tdmesh"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_workers_import_only_the_shared_layers():
    bad = [f"{m} imports {t}" for m, deps in GRAPH.items() if m.startswith("tdmesh.worker")
           for t, _ in deps if layer(t) not in WORKER_MAY_IMPORT]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    bad = [f"{m} imports {n} from {t}" for m, deps in GRAPH.items() for t, names in deps for n in names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_modules_stay_within_the_line_budget():
    long = {m: n for m, p in MODULES.items() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_layer_check_sees_an_upward_import():
    """The layer test is only as good as ``layer``: an engine module importing the public
    ``mesh`` or a worker importing the engine is named as going up."""
    assert LAYERS.index(layer("tdmesh.mesh")) > LAYERS.index(layer("tdmesh.engine.client"))
    assert layer("tdmesh.engine.client") not in WORKER_MAY_IMPORT
    assert layer("tdmesh.protocol.relay") in WORKER_MAY_IMPORT and layer("tdmesh.config") == "base"


def test_the_import_walk_sees_function_local_imports():
    """The checks above are only as good as the walk: it must see imports inside functions."""
    deps = dict((t, names) for t, names in GRAPH["tdmesh.worker.__main__"])
    assert "tdmesh.worker.loop" in deps  # imported inside main()
