"""The one error the loaders raise: a single line naming what failed to load and why."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """One clear line: '<path or id>: <problem>'."""

    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")


def first_line(error: BaseException) -> str:
    """A low-level exception squeezed to one line, for the '(...)' detail of a message."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
