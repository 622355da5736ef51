"""The `pagedllm` command, run as a subprocess exactly as a user would."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


def assert_one_error_line(result, fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert fragment in errors[0]


def test_help():
    top = pagedllm("--help")
    assert top.returncode == 0
    for command in ("serve", "generate", "chat", "bench"):
        assert command in top.stdout
    gen = pagedllm("generate", "--help")
    assert gen.returncode == 0
    for option in ("--raw", "--max-tokens", "--temperature", "--model"):
        assert option in gen.stdout
    serve = pagedllm("serve", "--help")
    assert serve.returncode == 0
    for option in ("--host", "--port", "--api-key", "--max-model-len", "--block-size"):
        assert option in serve.stdout
    bench = pagedllm("bench", "serve", "--help")
    assert bench.returncode == 0 and "--num-clients" in bench.stdout


def test_bad_options_exit_2():
    assert_one_error_line(pagedllm("serve", "--port", "eighty"), "--port")
    assert_one_error_line(pagedllm("generate"), "prompt")
    assert_one_error_line(pagedllm("generate", "hi", "--temperature", "-1"),
                          "temperature must be non-negative")
    assert_one_error_line(pagedllm("frobnicate"), "frobnicate")
    assert_one_error_line(pagedllm("bench", "serve", "--num-clients", "0"),
                          "--num-clients must be at least 1")


def test_missing_model_exits_2_without_traceback():
    result = pagedllm("generate", "hi", "--model", "/nonexistent")
    assert_one_error_line(result, "/nonexistent")
    assert result.stdout == ""


def test_port_in_use_exits_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = pagedllm("serve", "--port", str(port))
    assert_one_error_line(result, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.slow
def test_generate_answers_with_chat_template():
    result = pagedllm("generate", "What is the capital of France?", "--max-tokens", "32",
                      *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Loading" in result.stderr  # progress goes to stderr, the answer alone to stdout
    assert "Loading" not in result.stdout


@pytest.mark.slow
def test_chat_reads_stdin_and_keeps_history(default_llm):
    questions = ["My name is Alice.", "What is my name?"]
    result = pagedllm("chat", "--max-tokens", "24", *SMALL_ENGINE,
                      stdin="\n".join(questions) + "\n")
    assert result.returncode == 0, result.stderr

    # The same conversation, greedy, through the offline API.
    params = SamplingParams(temperature=0, max_tokens=24)
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
