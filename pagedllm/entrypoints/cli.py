"""The `pagedllm` command: serve | generate | chat | bench.

Bad options and models that fail to load print one line `error: <message>` and exit 2.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import logging
import os
import shlex
import sys
import threading
import time
from typing import NoReturn

from pagedllm.entrypoints.usage import EXIT_USAGE, Parser, UsageError
from pagedllm.entrypoints import lora_flags, serve_models, vllm_flags
from pagedllm.startup import paused_gc


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.engine_args import EngineArgs

    parser = Parser(prog="pagedllm", description="pagedllm: a PagedAttention LLM engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve the model over an OpenAI-compatible HTTP API.")
    vllm_flags.add_model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route that touches "
                       "the model (/v1/*, /tokenize, /detokenize, /tokenizer_info); /health, "
                       "/ping, /version and /metrics stay open")
    lora_flags.add_lora_args(serve)
    serve.add_argument("--metrics-need-key", action="store_true",
                       help="put /metrics behind --api-key too")
    serve.add_argument("--max-request-bytes", type=int, default=8 << 20,
                       help="larger request bodies are answered 413 unread (default: 8 MiB)")
    serve.add_argument("--max-tokens-default", type=int, default=None,
                       help="max_tokens of a request that sets none (default: 16 for "
                       "/v1/completions as OpenAI, the rest of the context for chat as vLLM)")
    serve.add_argument("--log-level", "--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="the HTTP server's (uvicorn's) log level (default: warning)")
    vllm_flags.add_serve_args(serve)
    vllm_flags.add_http_args(serve)
    EngineArgs.add_cli_args(serve)
    serve_models.add_models_args(serve)

    gen = sub.add_parser("generate", help="answer one prompt and stream it to stdout",
                         description="Answer one prompt, streaming the text to stdout.")
    gen.add_argument("prompt", help="the prompt (a user message unless --raw)")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the model's chat template")
    _add_sampling_args(gen)
    vllm_flags.add_template_args(gen)
    EngineArgs.add_cli_args(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (reads stdin)",
                          description="Chat with the model: one message per line on stdin; "
                          "/exit or end of input quits.")
    _add_sampling_args(chat)
    vllm_flags.add_template_args(chat)
    EngineArgs.add_cli_args(chat)

    from pagedllm.benchmarks import WORKLOAD_HELP

    width = max(map(len, WORKLOAD_HELP))
    bench = sub.add_parser(
        "bench", help="run a benchmark workload",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a benchmark workload; `pagedllm bench WORKLOAD --help` shows its "
        "options.\n\nworkloads:\n" + "\n".join(
            f"  {name:<{width}}  {text}" for name, text in WORKLOAD_HELP.items()),
    )
    bench.add_argument("workload", metavar="WORKLOAD", help="one of the workloads above")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="options of the workload")
    parser.set_defaults(commands={"serve": serve, "generate": gen, "chat": chat, "bench": bench})
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's options; an unknown flag is an error naming the closest known one."""
    args, extras = build_parser().parse_known_args(argv)
    if extras:
        raise vllm_flags.unknown_option(args.commands[args.command], extras)
    vllm_flags.resolve_model(args)
    return args


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=512, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 picks the most likely token (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--system", default=None, help="a system message for the chat template")


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; as the process's entry (argv None) it exits with it."""
    if argv is not None:
        return run_command(list(argv))
    exit_now(run_command(sys.argv[1:]))


def exit_now(code: int | None) -> NoReturn:
    """Exit as the interpreter would, less its teardown of every module and object (freeing
    torch, the weights and the KV cache one object at a time costs most of a second).

    The steps Python's own exit takes that anyone can observe are kept, in its order: the
    threads' shutdown (thread pools' exit hooks, then joining non-daemon threads), the
    atexit handlers (logging, multiprocessing children, temporary files, chat history),
    and flushing stdout and stderr, whose failure makes a clean exit 120 as in Python.
    """
    code = int(code or 0)
    getattr(threading, "_shutdown", lambda: None)()  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except OSError:  # e.g. the reader of the pipe has gone
            code = code or 120
    os._exit(code)


def run_command(argv: list[str]) -> int:
    try:
        # `bench WORKLOAD ...`: the workload parses its own options (and its own --help).
        if len(argv) >= 2 and argv[0] == "bench" and not argv[1].startswith("-"):
            return run_bench(argv[1], argv[2:])
        args = parse_args(argv)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "chat":
            return run_chat(args)
        return run_bench(args.workload, args.args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# ---------------------------------------------------------------- engine loading


def load_engine(args: argparse.Namespace):
    """Build the LLMEngine, showing progress on stderr; bad options or models -> UsageError."""
    with paused_gc(freeze=True):  # imports torch
        from pagedllm.engine_args import EngineArgs
        from pagedllm.engine.llm_engine import LLMEngine

    try:
        engine_args = EngineArgs.from_cli_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    shown = engine_args.model or "the default model (SmolLM2-135M-Instruct)"
    print(f"Loading {shown} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        engine = LLMEngine.from_engine_args(engine_args)
    except (ValueError, OSError) as exc:  # ModelLoadError is a ValueError
        raise UsageError(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) \
            from None
    template = vllm_flags.load_chat_template(getattr(args, "chat_template", None))
    if template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = template
    stats = engine.get_stats()
    print(
        f"Loaded {engine.model_name} in {time.perf_counter() - start:.1f} s "
        f"(context {engine.max_model_len} tokens, KV cache "
        f"{stats.num_gpu_blocks * stats.block_size} tokens)",
        file=sys.stderr, flush=True,
    )
    return engine


def _show_progress_logs(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("pagedllm")
    log.addHandler(handler)
    log.setLevel(level)


# ------------------------------------------------------------------------ serve


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    with paused_gc(freeze=True):  # imports torch, FastAPI and pydantic
        from pagedllm.distributed.parallel_state import torchrun_env
        from pagedllm.entrypoints.openai.api_server import ServerConfig, bind_socket, serve

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be at least 1, got {args.max_request_bytes}")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise UsageError(f"--max-tokens-default must be at least 1, got {args.max_tokens_default}")
    if args.metrics_need_key and args.api_key is None:
        raise UsageError("--metrics-need-key needs --api-key")
    vllm_flags.check_serve_args(args)
    http = vllm_flags.http_config(args)
    vllm_flags.load_chat_template(args.chat_template)  # a missing file fails before loading
    namespaces = serve_models.model_namespaces(args)
    serve_models.check_adapter_names(namespaces)  # before any model loads
    torchrun = torchrun_env()
    if torchrun is not None and len(namespaces) > 1:
        raise UsageError("several models in one server do not run under torchrun")
    if torchrun is not None and torchrun[1] != 0:
        load_engine(args)  # a torchrun rank other than 0 serves rank 0's steps, exits there
        return 0
    try:
        sock = bind_socket(args.host, args.port)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _show_progress_logs()
    engines = _load_engines(namespaces, not args.disable_log_stats)
    names = [name for engine in engines
             for name in getattr(engine.engine, "served_model_names", [engine.model_name])]

    def announce(url: str) -> None:
        print(ready_message(url, ", ".join(names), args.api_key, names[0]), flush=True)

    config = ServerConfig(api_key=args.api_key, metrics_need_key=args.metrics_need_key,
                          max_request_bytes=args.max_request_bytes,
                          max_tokens_default=args.max_tokens_default,
                          log_requests=args.log_requests,
                          reasoning_parser=args.reasoning_parser, **http)
    configs = [dataclasses.replace(config, sampling_defaults=vllm_flags.sampling_defaults(
        ns, engine.engine)) for ns, engine in zip(namespaces, engines)]
    asyncio.run(serve(engines[0], sock, configs[0], announce, args.log_level,
                      others=list(zip(engines[1:], configs[1:]))))
    for engine in engines:
        if engine.fatal_error is not None:
            print(f"error: the engine failed: {engine.fatal_error}", file=sys.stderr)
            return 1
    return 0


def _load_engines(namespaces: list[argparse.Namespace], log_stats: bool) -> list:
    """One AsyncLLMEngine per model, in order; two models may not share a name."""
    from pagedllm.engine.async_engine import AsyncLLMEngine

    engines: list = []
    seen: set[str] = set()
    names: list[serve_models.Names] = []  # the loaded models': adapter names stay unique
    for ns in namespaces:
        try:
            engine = load_engine(ns)
        except UsageError as exc:
            if len(namespaces) == 1:
                raise
            raise UsageError(f"model {serve_models.label(ns)}: {exc}") from None
        served = getattr(engine, "served_model_names", [engine.model_name])
        taken = seen.intersection(served)
        if taken:
            raise UsageError(f"two models are served as {sorted(taken)[0]!r}; give each its "
                             "own --served-model-name")
        seen.update(served)
        label, _, adapters = serve_models.names_before_loading(ns)
        names.append((label, list(served), adapters))
        clash = serve_models.adapter_name_clash(names)
        if clash is not None:
            raise UsageError(clash)
        _register_lora_modules(engine, getattr(ns, "lora_modules", None))
        engines.append(AsyncLLMEngine(engine, log_stats=log_stats))
    return engines


def _register_lora_modules(engine, modules) -> None:
    """--lora-modules into a loaded engine; a bad adapter is a usage error naming it."""
    if not modules:
        return
    from pagedllm.entrypoints.openai.lora_routes import register_modules

    try:
        register_modules(engine, modules)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def ready_message(url: str, model: str, api_key: str | None, example: str | None = None
                  ) -> str:
    body = json.dumps({"model": example or model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 64})
    auth = " -H 'Authorization: Bearer <your --api-key>'" if api_key else ""
    return (
        f"pagedllm is serving {model} at {url}  (Ctrl-C to stop)\n"
        f"Try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(body)}"
    )


# ------------------------------------------------------------- generate / chat


def _sampling_params(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def stream_answer(engine, prompt: str | list[int], params, request_id: str) -> str:
    """Run one request to the end, writing its text to stdout as it comes."""
    engine.add_request(request_id, prompt, params)
    text = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if out.error:
                    raise ValueError(out.error)
                delta = out.deltas[0][0] if out.deltas else ""
                if delta:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                    text.append(delta)
                if out.finished:
                    return "".join(text)
    finally:
        engine.abort_request(request_id)  # a no-op once it has finished
    return "".join(text)


def _chat_prompt(engine, messages: list[dict]) -> list[int]:
    from pagedllm.entrypoints.chat_utils import apply_chat_template

    return apply_chat_template(engine.tokenizer, messages)  # as LLM.chat


def _has_chat_template(engine) -> bool:
    return engine.tokenizer is not None and bool(getattr(engine.tokenizer, "chat_template", None))


def run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = load_engine(args)
    prompt: str | list[int] = args.prompt
    if not args.raw:
        if _has_chat_template(engine):
            messages = [{"role": "system", "content": args.system}] if args.system else []
            prompt = _chat_prompt(engine, messages + [{"role": "user", "content": args.prompt}])
        else:
            print("note: the model has no chat template; sending the prompt as is",
                  file=sys.stderr)
    try:
        stream_answer(engine, prompt, params, "generate-0")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sys.stdout.write("\n")
    return 0


CHAT_HISTORY = "~/.cache/pagedllm/chat_history"


def _use_readline() -> None:
    """Line editing and history for input() at a terminal (readline, where Python has it);
    the history persists in CHAT_HISTORY when that folder can be written."""
    try:
        import readline
    except ImportError:  # e.g. Windows: plain input()
        return
    import atexit
    from pathlib import Path

    path = Path(CHAT_HISTORY).expanduser()
    readline.set_history_length(1000)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            readline.read_history_file(path)
    except OSError:
        return  # history for this session only
    atexit.register(_save_history, readline, path)


def _save_history(readline, path) -> None:
    try:
        readline.write_history_file(path)
    except OSError:
        pass


def run_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = load_engine(args)
    if not _has_chat_template(engine):
        raise UsageError("the model has no chat template; use `pagedllm generate --raw`")
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        _use_readline()
        print("Type a message and press Enter; /exit or Ctrl-D quits.", file=sys.stderr)
    for turn in range(sys.maxsize):
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        history.append({"role": "user", "content": line})
        try:
            answer = stream_answer(engine, _chat_prompt(engine, history), params, f"chat-{turn}")
        except ValueError as exc:  # e.g. the conversation outgrew the context
            history.pop()
            print(f"\nerror: {exc}", file=sys.stderr, flush=True)
            continue
        except KeyboardInterrupt:  # stop this answer, keep the conversation
            history.pop()
            print("\n[interrupted]", file=sys.stderr, flush=True)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": answer})
    return 0


# ------------------------------------------------------------------------ bench


def run_bench(workload: str, argv: list[str]) -> int:
    import importlib

    from pagedllm.benchmarks import STANDALONE

    if workload in STANDALONE:
        return importlib.import_module(f"pagedllm.benchmarks.{STANDALONE[workload]}").main(argv)
    from pagedllm.benchmarks import workloads  # imported here: it pulls in the peers

    return workloads.main([workload, *argv])


if __name__ == "__main__":
    sys.exit(main())
