"""Every command in the docs runs as written: the fenced shell blocks of README.md and
docs/*.md are read, and each `pagedllm ...` (also `.venv/bin/pagedllm`, `python -m
pagedllm.entrypoints.cli`, under `torchrun -m`) must name a real subcommand (and bench
workload) and only flags that its --help lists; each `make ...` a target and variables of
the Makefile; each `bash FILE` / `python FILE` a file of the repository. README's engine
options table must be `scripts/options_table.py`'s output."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import build_parser, run_bench

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|"}
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def shell_commands(text: str) -> list[list[str]]:
    """The commands of the text's fenced shell blocks, as argument lists (continuation lines
    joined, comments dropped, split at `&&`, `;`, `|`)."""
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if lang not in SHELLS:
            continue
        pending = ""
        for line in body.replace("\\\n", " ").splitlines():
            pending += line + "\n"
            try:  # a quoted string may span lines (curl -d '{...}')
                words = shlex.split(pending, comments=True)
            except ValueError:
                continue
            pending = ""
            command: list[str] = []
            for word in words:
                if word in SEPARATORS:
                    commands.append(command)
                    command = []
                else:
                    command.append(word)
            commands.append(command)
    return [c for c in commands if c]


@cache
def makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):(?!=)", text, re.M))
    variables = set(re.findall(r"^(\w+)\s*[?:]?=", text, re.M))
    return targets, variables


@cache
def subcommand_flags(command: str | None) -> set[str]:
    parser = build_parser()
    if command is not None:
        parser = parser.get_default("commands")[command]
    return {s for action in parser._actions for s in action.option_strings}


@cache
def workload_help(workload: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        run_bench(workload, ["--help"])
    return out.getvalue()


def check_pagedllm(args: list[str]) -> list[str]:
    """Problems with `pagedllm ARGS`."""
    if not args or args[0].startswith("-"):
        return [f"--flag {a!r} not in `pagedllm --help`" for a in args
                if a.startswith("-") and a not in subcommand_flags(None)]
    command, rest = args[0], args[1:]
    commands = build_parser().get_default("commands")
    if command not in commands:
        return [f"no subcommand {command!r} (pagedllm has {', '.join(commands)})"]
    known = subcommand_flags(command)
    where = f"`pagedllm {command} --help`"
    if command == "bench" and rest and not rest[0].startswith("-"):
        from pagedllm.benchmarks import WORKLOAD_HELP

        if rest[0] not in WORKLOAD_HELP:
            return [f"no bench workload {rest[0]!r}"]
        where = f"`pagedllm bench {rest[0]} --help`"
        known = set(FLAG.findall(workload_help(rest[0])))
        rest = rest[1:]
    flags = [a.split("=", 1)[0] for a in rest if FLAG.fullmatch(a.split("=", 1)[0])]
    return [f"flag {f!r} not in {where}" for f in flags if f not in known]


def check_command(words: list[str]) -> list[str]:
    """Problems with one shell command; commands of other programs pass unchecked."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return []
    program, args = Path(words[0]).name, words[1:]
    if program == "pagedllm":
        return check_pagedllm(args)
    if program == "make":
        targets, variables = makefile()
        problems = [f"no make target {a!r}" for a in args if "=" not in a and a not in targets]
        return problems + [f"no Makefile variable {a.split('=')[0]!r}" for a in args
                           if "=" in a and a.split("=")[0] not in variables]
    if program in ("python", "python3", "torchrun") and "-m" in args:
        module, rest = args[args.index("-m") + 1], args[args.index("-m") + 2:]
        if module == "pagedllm.entrypoints.cli":
            return check_pagedllm(rest)
        if module.startswith("pagedllm") and importlib.util.find_spec(module) is None:
            return [f"no module {module!r}"]
        return []
    if program in ("bash", "python", "python3") and args and not args[0].startswith("-"):
        if args[0].endswith((".sh", ".py")) and not (ROOT / args[0]).is_file():
            return [f"no file {args[0]!r}"]
    return []


def doc_commands() -> list[tuple[str, list[str]]]:
    return [(path.relative_to(ROOT).as_posix(), words) for path in DOCS
            for words in shell_commands(path.read_text())]


@pytest.mark.parametrize("where,words", doc_commands(), ids=lambda v: v if isinstance(v, str)
                         else " ".join(v)[:60])
def test_documented_command_exists(where: str, words: list[str]) -> None:
    assert check_command(words) == [], f"{where}: {shlex.join(words)}"


def test_the_checker_catches_a_made_up_flag_subcommand_and_target() -> None:
    text = ("```bash\npagedllm serve --port 1 --made-up-flag 3   # a comment --not-a-flag\n"
            "pagedllm bench spec --method ngram --no-such-option\n"
            "pagedllm servee\nGPU=1 make no-such-target\n"
            "torchrun --nproc-per-node 2 -m pagedllm.entrypoints.cli serve \\\n"
            "    --tensor-parallel-size 2 --bogus\n```\n")
    problems = [check_command(words) for words in shell_commands(text)]
    assert problems == [
        ["flag '--made-up-flag' not in `pagedllm serve --help`"],
        ["flag '--no-such-option' not in `pagedllm bench spec --help`"],
        ["no subcommand 'servee' (pagedllm has serve, generate, chat, bench)"],
        ["no make target 'no-such-target'"],
        ["flag '--bogus' not in `pagedllm serve --help`"],
    ]


def test_readme_options_table_is_generated_from_engine_args() -> None:
    spec = importlib.util.spec_from_file_location("options_table",
                                                  ROOT / "scripts" / "options_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.options_table()
    assert table in (ROOT / "README.md").read_text(), (
        "README's engine options table differs from `python scripts/options_table.py`")


def server_routes() -> set[str]:
    """Every path the server's source registers (`@router.get("/...")`, `add_api_route`),
    with path parameters written `{}`."""
    paths = set()
    for source in (ROOT / "pagedllm" / "entrypoints").rglob("*.py"):
        text = source.read_text()
        paths |= set(re.findall(r'\.(?:get|post|put|delete|api_route)\(\s*"(/[^"]*)"', text))
        paths |= set(re.findall(r'add_api_route\(\s*"(/[^"]*)"', text))
    return {re.sub(r"\{[^}]*\}", "{}", p) for p in paths}


def test_readme_route_table_lists_every_route() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| route | auth | what |"):readme.index("Requests, in short")]
    listed = {re.sub(r"\{[^}]*\}", "{}", p) for p in re.findall(r"(/[\w/{}.-]*)", table)}
    assert len(server_routes()) > 15
    assert server_routes() - listed == set()
