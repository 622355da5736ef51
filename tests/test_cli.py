"""The `pagedllm` command, run as a subprocess exactly as a user would."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.cli import main
from pagedllm.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
# Skip profiling and keep the caches small: these runs only need a few hundred tokens.
SMALL_ENGINE = ["--num-gpu-blocks-override", "64", "--swap-space", "0.01"]


def pagedllm(*args: str, stdin: str | None = None, timeout: float = 300):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args], cwd=REPO, env=env,
        input=stdin, capture_output=True, text=True, timeout=timeout,
    )


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """The same `main` the console script calls, in-process (cheap checks need no model)."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's --help
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    for command in ("serve", "generate", "chat", "bench"):
        assert command in out
    code, out, _ = run_main(capsys, "generate", "--help")
    assert code == 0
    for option in ("--raw", "--max-tokens", "--temperature", "--model"):
        assert option in out
    code, out, _ = run_main(capsys, "serve", "--help")
    assert code == 0
    for option in ("--host", "--port", "--api-key", "--max-model-len", "--block-size"):
        assert option in out
    code, out, _ = run_main(capsys, "bench", "serve", "--help")
    assert code == 0 and "--num-clients" in out
    code, out, _ = run_main(capsys, "bench", "load", "--help")
    assert code == 0 and "--repeats" in out


def test_bench_help_lists_every_workload_on_one_line(capsys):
    from pagedllm.benchmarks import STANDALONE, WORKLOAD_HELP, workloads

    assert set(WORKLOAD_HELP) == {*workloads.WORKLOADS, *STANDALONE}
    code, out, _ = run_main(capsys, "bench", "--help")
    assert code == 0
    lines = out.splitlines()
    for name, text in WORKLOAD_HELP.items():
        assert any(line.split() == [name, *text.split()] for line in lines), name


def test_help_imports_neither_torch_nor_transformers():
    """`pagedllm --help` answers at once: the package's names load on first use."""
    code = ("import sys; import pagedllm; from pagedllm.entrypoints.cli import build_parser; "
            "pagedllm.SamplingParams; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.stdout.strip() == "[]", result.stderr


def test_engine_flags_are_generated_from_engine_args():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()  # the same defaults
    argv = ["--no-disable-log-stats", "--no-enable-prefix-caching", "--enforce-eager",
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5,0.7", "--dtype", "float16",
            "--swap-space", "0.5"]
    assert EngineArgs.from_cli_args(parser.parse_args(argv)) == EngineArgs(
        disable_log_stats=False, enable_prefix_caching=False, enforce_eager=True, max_num_seqs=8,
        gpu_memory_utilization="0.5,0.7", dtype="float16", swap_space=0.5)


@pytest.mark.parametrize("argv,fragment", [
    (["serve", "--port", "eighty"], "--port"),
    (["serve", "--port", "70000"], "--port must be in [0, 65535]"),
    (["generate"], "prompt"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be non-negative"),
    (["generate", "hi", "--dtype", "float8"], "--dtype"),
    (["frobnicate"], "frobnicate"),
    (["bench", "serve", "--num-clients", "0"], "--num-clients must be at least 1"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--bogus"], "--bogus"),
    (["bench", "no-such-workload"], "unknown benchmark workload 'no-such-workload'"),
    (["bench", "load", "--repeats", "0"], "--repeats must be at least 1"),
])
def test_bad_options_exit_2(capsys, argv, fragment):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err


def test_port_in_use_exits_2(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_main(capsys, "serve", "--port", str(port))
    assert code == 2
    assert err == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_missing_model_exits_2_without_traceback():
    result = pagedllm("generate", "hi", "--model", "/nonexistent")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "/nonexistent" in errors[0]


@pytest.mark.slow
def test_generate_answers_with_chat_template():
    result = pagedllm("generate", "What is the capital of France?", "--max-tokens", "16",
                      *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Loading" in result.stderr  # progress goes to stderr, the answer alone to stdout
    assert "Loading" not in result.stdout


@pytest.mark.slow
def test_chat_reads_stdin_and_keeps_history(default_llm):
    questions = ["My name is Alice.", "What is my name?"]
    # float32: the weights of default_llm, which it is compared with token for token
    result = pagedllm("chat", "--max-tokens", "12", "--dtype", "float32", *SMALL_ENGINE,
                      stdin="\n".join(questions) + "\n")
    assert result.returncode == 0, result.stderr

    # The same conversation, greedy, through the offline API.
    params = SamplingParams(temperature=0, max_tokens=12)
    history, answers = [], []
    for question in questions:
        history.append({"role": "user", "content": question})
        answer = default_llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": answer})
        answers.append(answer)
    assert result.stdout == "".join(a + "\n" for a in answers)
    # Without the history the second answer would differ, so the check above needs it.
    alone = default_llm.chat([history[2]], params, use_tqdm=False)[0].outputs[0].text
    assert alone != answers[1]
