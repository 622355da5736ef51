"""The top floor stays readable: no function in engine/ or worker/ over 60 lines, and the
engine's step loop (engine/core.py) in at most 300 lines."""
from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent
MAX_FUNCTION_LINES = 60
MAX_CORE_LINES = 300


def long_functions(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # From the def (decorators not counted) to its last line.
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                 f"({lines} lines)")
    return found


def test_no_function_in_engine_or_worker_is_over_60_lines():
    assert long_functions("engine") + long_functions("worker") == []


def test_engine_core_is_at_most_300_lines():
    lines = len((ROOT / "engine" / "core.py").read_text().splitlines())
    assert lines <= MAX_CORE_LINES, f"engine/core.py has {lines} lines"


def test_the_step_fits_on_one_screen():
    tree = ast.parse((ROOT / "engine" / "core.py").read_text())
    (step,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_step"]
    assert step.end_lineno - step.lineno + 1 <= 40
