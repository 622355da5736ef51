"""Print the engine options of `pagedllm serve` (EngineArgs.add_cli_args) as a markdown table.

    python scripts/options_table.py

README.md's "Engine options" table is this output; tests/test_readme.py checks they agree.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.entrypoints.cli import build_parser  # noqa: E402


def engine_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of `parser`'s "engine" argument group."""
    group = next(g for g in parser._action_groups if g.title == "engine")
    return list(group._group_actions)


def options_table() -> str:
    serve = build_parser().get_default("commands")["serve"]
    formatter = serve._get_formatter()
    rows = ["| flag | what |", "|---|---|"]
    for action in engine_actions(serve):
        flags = ", ".join(f"`{s}`" for s in action.option_strings)
        text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {flags} | {' '.join(text.split()).replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(options_table())
