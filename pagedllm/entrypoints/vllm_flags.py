"""The `pagedllm serve` flags that follow vLLM's habits: the positional MODEL, request
logging, the tool-call and reasoning parsers, the chat template, the generation config.

Each resolves to plain values before the engine loads (a bad one is a UsageError); the
server reads them from the parsed namespace.
"""
from __future__ import annotations

import argparse
import difflib
import json
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


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """CORS (vLLM's names, off by default), the API docs, the connection's limits."""
    g = parser.add_argument_group("HTTP")
    g.add_argument("--allowed-origins", default=None, metavar="LIST",
                   help='CORS: origins allowed to call the API, as JSON (\'["*"]\') or '
                   "comma-separated (default: none, no CORS headers at all)")
    g.add_argument("--allowed-methods", default='["*"]', metavar="LIST",
                   help='CORS: allowed methods, with --allowed-origins (default: ["*"])')
    g.add_argument("--allowed-headers", default='["*"]', metavar="LIST",
                   help='CORS: allowed request headers, with --allowed-origins '
                   '(default: ["*"])')
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow cookies and Authorization, with --allowed-origins")
    g.add_argument("--enable-fastapi-docs", action="store_true",
                   help="serve Swagger UI at /docs and ReDoc at /redoc (off by default: "
                   "their pages load JavaScript and CSS from a CDN, cdn.jsdelivr.net, so "
                   "they stay blank offline)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="as vLLM: no /openapi.json either (it is served by default)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="close a keep-alive connection idle this long (default: 5)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a connection that has not sent a whole request head this long "
                   "after connecting (or after its last response) is answered 408 and "
                   "closed (default: 10)")
    g.add_argument("--max-connections", type=int, default=1000, metavar="N",
                   help="requests beyond N open connections are answered 503 (default: "
                   "1000)")
    g.add_argument("--h11-max-incomplete-event-size", type=int, default=16 << 10,
                   metavar="BYTES", help="the largest request head; a larger one is "
                   "answered 400 (default: 16384)")


def _origin_list(flag: str, value: str) -> list[str]:
    """A JSON list of strings (vLLM's form) or comma-separated values."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{flag}: not a JSON list: {exc}") from None
        if not all(isinstance(item, str) for item in items):
            raise UsageError(f"{flag}: a JSON list of strings, got {value}")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


def http_config(args: argparse.Namespace) -> dict:
    """The ServerConfig fields of add_http_args' flags; a bad value is a UsageError."""
    for flag, value in (("--timeout-keep-alive", args.timeout_keep_alive),
                        ("--header-timeout", args.header_timeout)):
        if not value > 0:
            raise UsageError(f"{flag} must be a positive number of seconds, got {value}")
    for flag, count in (("--max-connections", args.max_connections),
                        ("--h11-max-incomplete-event-size",
                         args.h11_max_incomplete_event_size)):
        if count < 1:
            raise UsageError(f"{flag} must be at least 1, got {count}")
    if args.enable_fastapi_docs and args.disable_fastapi_docs:
        raise UsageError("--enable-fastapi-docs and --disable-fastapi-docs contradict")
    origins = (_origin_list("--allowed-origins", args.allowed_origins)
               if args.allowed_origins is not None else None)
    return dict(
        allowed_origins=origins,
        allowed_methods=_origin_list("--allowed-methods", args.allowed_methods),
        allowed_headers=_origin_list("--allowed-headers", args.allowed_headers),
        allow_credentials=args.allow_credentials,
        docs=args.enable_fastapi_docs, openapi=not args.disable_fastapi_docs,
        timeout_keep_alive=args.timeout_keep_alive, header_timeout=args.header_timeout,
        max_connections=args.max_connections,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
    )


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
