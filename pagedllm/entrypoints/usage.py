"""UsageError and the argparse Parser that raises it: every `pagedllm` command (the CLI, its
bench workloads) reports a bad option as one `error: <message>` line and exits 2."""
from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem the user can fix from the command line: one `error:` line, exit 2."""


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (as vLLM): `--max-model` is an error, not --max-model-len."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")
