"""The `pagedllm serve` flags that follow vLLM's habits: the positional MODEL, request
logging, the tool-call and reasoning parsers, the chat template, the generation config.

Each resolves to plain values before the engine loads (a bad one is a UsageError); the
server reads them from the parsed namespace.
"""
from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from pagedllm.entrypoints.usage import UsageError

TOOL_CALL_PARSERS = ("hermes",)  # <tool_call>{"name": ..., "arguments": ...}</tool_call>
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="the model, as --model (vLLM's `serve MODEL`)")


def add_template_args(parser: argparse.ArgumentParser) -> None:
    """What generate and chat share with serve: the chat template, trust_remote_code."""
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, as a file or inline, instead of the "
                        "model's")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted as vLLM's; pagedllm implements its architectures itself "
                        "and never runs a checkpoint's code")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_template_args(parser)
    parser.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                        default=False, help="log one line per request (id, prompt tokens, "
                        "sampling params)")
    parser.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                        help="log no requests (the default)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='accepted as vLLM\'s: tool_choice "auto" is always on')
    parser.add_argument("--tool-call-parser", default="hermes", metavar="NAME",
                        help="how tool calls are written: hermes (the only one)")
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="qwen3 | deepseek_r1: the text between <think> and </think> goes "
                        "to reasoning_content, and a response_format or tool grammar starts "
                        "after it")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="auto: requests default to the model's own sampling settings "
                        "(generation_config.json, GGUF general.sampling.*); vllm: ignore "
                        "them; DIR: a folder's generation_config.json (default: auto)")


def resolve_model(args: argparse.Namespace) -> None:
    """`serve MODEL` and `--model MODEL` are one option."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise UsageError(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag


def check_serve_args(args: argparse.Namespace) -> None:
    if args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise UsageError(f"--tool-call-parser {args.tool_call_parser!r} is not supported: "
                         "pagedllm reads tool calls in the hermes format only")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise UsageError(f"--reasoning-parser {args.reasoning_parser!r} is not supported; "
                         f"choose from {', '.join(REASONING_PARSERS)}")
    setting = args.generation_config
    if setting not in ("auto", "vllm") and not Path(setting).is_dir():
        raise UsageError(f"--generation-config must be auto, vllm or a folder, got {setting!r}")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's text, or the template itself when the value
    looks like one (it has braces or a newline); anything else is a missing file."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--chat-template: cannot read {value}: {exc}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise UsageError(f"--chat-template: no such file: {value} (an inline template has "
                     "{{ }} or {% %} tags)")


def unknown_option(parser: argparse.ArgumentParser, extras: list[str]) -> UsageError:
    """The error for arguments `parser` does not know, naming the closest known flag."""
    first = extras[0]
    known = [s for action in parser._actions for s in action.option_strings]
    if first.startswith("-"):
        close = difflib.get_close_matches(first.split("=", 1)[0], known, n=1, cutoff=0.7)
        hint = f"; did you mean {close[0]}?" if close else ""
        return UsageError(f"unrecognized argument {first}{hint} (see `{parser.prog} --help`)")
    return UsageError(f"unrecognized arguments: {' '.join(extras)} "
                      f"(see `{parser.prog} --help`)")


def sampling_defaults(args: argparse.Namespace, engine) -> dict:
    """--generation-config's defaults for requests that leave a sampling field unset."""
    from pagedllm.loader.errors import ModelLoadError
    from pagedllm.loader.generation_config import generation_defaults

    setting = args.generation_config
    if setting == "vllm":
        return {}
    path = getattr(engine.worker, "source_path", None) if setting == "auto" else setting
    try:
        return generation_defaults(path)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
