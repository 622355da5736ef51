"""The package layering, checked on the source: imports run only downward and no module
imports itself back through others (docs/architecture.md draws the layers).

    ground floor (config, outputs, sampling_params, engine_args)
      < distributed < kernels < layers < models < loader < lora < worker < engine < entrypoints < benchmarks

Every `import` counts, wherever it is written: at the top of a module, inside a function
(lazy), or under `if TYPE_CHECKING:`. A package may import its own modules freely (but
without a cycle). Anything else needs an entry in ALLOWED, with the reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent
GROUND_FLOOR = {"pagedllm.config", "pagedllm.outputs", "pagedllm.sampling_params",
                "pagedllm.contract",
                "pagedllm.pooling_params",
                "pagedllm.structured_grammar",
                "pagedllm.engine_args",
                "pagedllm.startup"}
PACKAGES = ["distributed", "kernels", "layers", "models", "loader", "lora", "worker", "engine", "entrypoints",
            "benchmarks"]

# (importer, imported) module-name prefixes that may import upward, and why. Keep it short.
ALLOWED = {
    # The `bench` subcommand lists the workloads (benchmarks.WORKLOAD_HELP: a dict, no torch)
    # and hands its arguments to them, imported only when run.
    ("pagedllm.entrypoints.cli", "pagedllm.benchmarks"):
        "`pagedllm bench` lists the workloads and runs them (a lazy import in run_bench)",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def level(module: str) -> int:
    """0 for the ground floor, then 1 + the package's place in PACKAGES. The package's own
    __init__ (`from pagedllm import LLM`) is the public API: the entrypoints' level."""
    if module in GROUND_FLOOR:
        return 0
    if module == "pagedllm":
        return 1 + PACKAGES.index("entrypoints")
    package = module.split(".")[1]
    assert package in PACKAGES, (
        f"{module} is in no layer: add {package!r} to PACKAGES (or the module to "
        f"GROUND_FLOOR) in tests/test_layering.py and to docs/architecture.md")
    return 1 + PACKAGES.index(package)


def imports(module: str) -> list[tuple[str, int]]:
    """(imported pagedllm module, line) for every import statement of the module."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("pagedllm")]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: use absolute imports"
            if not (node.module or "").startswith("pagedllm"):
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{node.module}.{alias.name}"
                found.append((sub if sub in MODULES else node.module, node.lineno))
    for target, line in found:
        assert target in MODULES, f"{module}:{line} imports {target}, which does not exist"
    return found


def allowed(importer: str, target: str) -> bool:
    return any(importer.startswith(a) and target.startswith(b) for a, b in ALLOWED)


def test_every_import_runs_downward():
    upward = sorted({
        f"{MODULES[m].relative_to(ROOT.parent)}:{line}: {m} imports {t}"
        for m in MODULES for t, line in imports(m)
        if level(t) > level(m) and not allowed(m, t)
    })
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_allowed_upward_imports_still_exist():
    """An entry nothing needs any more goes (so the list only shrinks)."""
    used = {(a, b) for a, b in ALLOWED
            for m in MODULES if m.startswith(a)
            for t, _ in imports(m) if t.startswith(b) and level(t) > level(m)}
    assert used == set(ALLOWED), f"unused entries: {sorted(set(ALLOWED) - used)}"


def test_no_import_cycle():
    graph = {m: sorted({t for t, _ in imports(m) if t != m}) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# engine/ reaches worker/ only through the contract (pagedllm.contract: the plain data and
# the Executor protocol) and the one factory that makes an Executor.
ENGINE_TO_WORKER = {("pagedllm.worker.tp_worker", "create_worker")}


def test_engine_reaches_the_worker_only_through_the_contract():
    found = []
    for module, path in MODULES.items():
        if not module.startswith("pagedllm.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found += [f"{module}:{node.lineno} import {a.name}" for a in node.names
                          if a.name.startswith("pagedllm.worker")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "pagedllm.worker"):
                found += [f"{module}:{node.lineno} from {node.module} import {a.name}"
                          for a in node.names if (node.module, a.name) not in ENGINE_TO_WORKER]
    assert not found, "engine/ imports the worker past the contract:\n" + "\n".join(found)
