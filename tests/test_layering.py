"""The architecture, held: which package may import which, read from the source with `ast`.

Every import counts, module-level, function-level and under TYPE_CHECKING alike. The rules
(docs/architecture.md draws them):

- common/ is the shared base and imports nothing of ours but itself;
- worker/ and gateway/ are sibling processes: each imports common/ and itself, never the other;
  the gateway never imports torch, and the worker's engine core (scheduler, block manager,
  sequence, plan, config, outputs) needs no torch, not even through a module it imports;
- cli/ (the launcher) sits on top: it may import anything and nothing imports it;
- inside gateway/ a module imports only its own rank or lower (GATEWAY_RANKS), and starlette
  and uvicorn appear only in gateway/http/ and the composition above it (app, server);
- there are no import circles;
- every package folder is a package in pyproject.toml (an editable install would hide a
  missing one; `pip install .` in the Dockerfile would not).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from zeroserve.cli.harness import REPO_ROOT

LAYERS = ("common", "worker", "gateway", "cli")
MAY_IMPORT = {
    "common": {"common"},
    "worker": {"common", "worker"},
    "gateway": {"common", "gateway"},
    "cli": {"common", "worker", "gateway", "cli"},
}
# gateway/: lowest first. A top-level module is named by its stem, a sub-package by its folder.
GATEWAY_RANKS = {
    "__init__": 0, "config": 0, "errors": 0, "logging": 0, "key_limits": 0,
    "priority_classes": 0, "fair_queue": 0, "queue_stats": 0, "class_shares": 0,
    "text": 1, "workers": 1, "observability": 1,
    "core": 2, "streams": 2, "generation": 2, "admission": 2, "reconcile": 2,
    "api": 3,
    "http": 4,
    "app": 5, "server": 5,
}
ENGINE_CORE = ("scheduler", "block_manager", "sequence", "plan", "config", "outputs")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    modules = {}
    for layer in LAYERS:
        for path in sorted((REPO_ROOT / layer).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Every module an import in this file names: ours as 'gateway.core' (the `zeroserve.`
    prefix dropped), others by their top-level name ('torch')."""
    names = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from zeroserve.worker import cpu_kernels` names a module, not an attribute.
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            assert not isinstance(node, ast.ImportFrom) or node.level == 0, \
                f"{path}: relative import; use the absolute zeroserve.* name"
            continue
        for target in targets:
            if target.startswith("zeroserve."):
                names.add(target.removeprefix("zeroserve."))
            elif target == "zeroserve":
                names.add(target)
            else:
                names.add(target.split(".")[0])
    return names


def import_graph() -> dict[str, set[str]]:
    """Our module -> the modules of ours it imports."""
    modules = source_modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = {n for n in imported_names(path) if n in modules and n != name}
    return graph


def third_party(name: str) -> set[str]:
    path = source_modules()[name]
    return {n for n in imported_names(path) if n.split(".")[0] not in LAYERS}


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def gateway_rank(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    assert key in GATEWAY_RANKS, (f"{module}: give gateway/{key} a rank in GATEWAY_RANKS "
                                  "(tests/test_layering.py) and in docs/architecture.md")
    return GATEWAY_RANKS[key]


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, deps in import_graph().items():
        layer = module.split(".")[0]
        wrong += [f"{module} -> {dep}" for dep in deps if dep.split(".")[0] not in MAY_IMPORT[layer]]
    assert wrong == []


def test_the_gateway_never_imports_torch():
    graph = import_graph()
    wrong = [f"{m} -> {t}" for m in graph if m.startswith("gateway")
             for t in third_party(m) if t == "torch"]
    assert wrong == []


def test_starlette_and_uvicorn_live_only_in_the_http_layer():
    graph = import_graph()
    wrong = [f"{m} -> {t}" for m in graph if m.startswith("gateway")
             and gateway_rank(m) < GATEWAY_RANKS["http"]
             for t in third_party(m) if t in ("starlette", "uvicorn")]
    assert wrong == []


def test_the_engine_core_needs_no_torch():
    graph = import_graph()
    for core in ENGINE_CORE:
        reached = closure(graph, f"worker.{core}")
        uses_torch = sorted(m for m in reached if "torch" in third_party(m))
        assert uses_torch == [], f"worker.{core} reaches torch through {uses_torch}"


def test_gateway_modules_import_their_own_rank_or_lower():
    wrong = []
    for module, deps in import_graph().items():
        if not module.startswith("gateway"):
            continue
        rank = gateway_rank(module)
        wrong += [f"{module} (rank {rank}) -> {dep} (rank {gateway_rank(dep)})"
                  for dep in deps if dep.startswith("gateway") and gateway_rank(dep) > rank]
    assert wrong == []


def test_there_are_no_import_circles():
    graph = import_graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert circles == []


def test_every_package_folder_is_installed():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = config["package-dir"]
    installed = set()
    for package in config["packages"]:
        top = ".".join(package.split(".")[:2])
        folder = Path(package_dir[top], *package.split(".")[2:])
        installed.add(folder.as_posix())
    folders = {path.parent.relative_to(REPO_ROOT).as_posix()
               for layer in LAYERS for path in (REPO_ROOT / layer).rglob("__init__.py")}
    assert sorted(folders - installed) == []
    assert sorted(installed - folders) == []
