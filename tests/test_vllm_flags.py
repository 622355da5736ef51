"""vLLM's CLI habits through the real parser (no model loads), and the reasoning split."""
from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.engine_args import EngineArgs, human_readable_int
from pagedllm.entrypoints import vllm_flags
from pagedllm.entrypoints.cli import main, parse_args
from pagedllm.entrypoints.reasoning import (
    ReasoningSplitter, constrain_after_thinking, split_reasoning, thinking_grammar,
    thinking_mode,
)
from pagedllm.entrypoints.usage import UsageError
from pagedllm.loader.generation_config import generation_defaults
from pagedllm.sampling_params import StructuredOutputsParams


def serve_args(*argv: str) -> argparse.Namespace:
    return parse_args(["serve", *argv])


def engine_args(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(serve_args(*argv))


def usage_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_model_positional_or_flag():
    assert serve_args("/models/x.gguf").model == "/models/x.gguf"
    assert serve_args("--model", "/models/x.gguf").model == "/models/x.gguf"
    assert serve_args("m", "--model", "m").model == "m"
    assert serve_args().model is None
    with pytest.raises(UsageError, match="the model is given twice: 'a' and --model 'b'"):
        serve_args("a", "--model", "b")


def test_tp_dtype_and_max_model_len_forms():
    assert engine_args("-tp", "2").tensor_parallel_size == 2
    assert engine_args("--tensor-parallel-size", "3").tensor_parallel_size == 3
    for name, dtype in [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"),
                        ("float16", "float16"), ("float32", "float32"), ("auto", "auto")]:
        assert engine_args("--dtype", name).dtype == dtype
    assert EngineArgs(dtype="half").dtype == "float16"  # LLM(dtype="half") as well
    for text, value in [("32k", 32_000), ("32K", 32_768), ("1.5k", 1_500), ("2m", 2_000_000),
                        ("1M", 1 << 20), ("4096", 4096)]:
        assert engine_args("--max-model-len", text).max_model_len == value
        assert engine_args("--max-num-batched-tokens", text).max_num_batched_tokens == value
        assert human_readable_int(text) == value


@pytest.mark.parametrize("argv,fragment", [
    (["--max-model-len", "1.5K"], "a binary suffix (K) takes a whole number; did you mean 1.5k?"),
    (["--max-model-len", "lots"], "invalid integer 'lots'"),
    (["--dtype", "float8"], "--dtype"),
    (["--tenser-parallel-size", "2"],
     "unrecognized argument --tenser-parallel-size; did you mean --tensor-parallel-size?"),
    (["--max-model", "2k"], "unrecognized argument --max-model; did you mean --max-model-len?"),
    (["--servedmodel-name", "a"], "did you mean --served-model-name?"),
    (["--zzz"], "unrecognized argument --zzz (see `pagedllm serve --help`)"),
    (["--tool-call-parser", "mistral"],
     "--tool-call-parser 'mistral' is not supported: pagedllm reads tool calls in the hermes "
     "format only"),
    (["--reasoning-parser", "granite"],
     "--reasoning-parser 'granite' is not supported; choose from qwen3, deepseek_r1"),
    (["--generation-config", "/no/such/dir"],
     "--generation-config must be auto, vllm or a folder, got '/no/such/dir'"),
    (["--chat-template", "/no/such/template.jinja"],
     "--chat-template: no such file: /no/such/template.jinja"),
    (["--uvicorn-log-level", "loud"], "--log-level/--uvicorn-log-level"),
])
def test_bad_flags_name_the_problem(capsys, argv, fragment):
    assert fragment in usage_error(capsys, "serve", *argv)


def test_abbreviations_are_refused(capsys):
    """allow_abbrev is off (as vLLM): a prefix of a flag is not that flag."""
    assert "--max-num-seq" in usage_error(capsys, "generate", "hi", "--max-num-seq", "4")


def test_served_model_names_and_frontend_flags(tmp_path):
    args = serve_args("--served-model-name", "a", "b", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
                      "--uvicorn-log-level", "debug", "--trust-remote-code",
                      "--enable-log-requests", "--generation-config", "vllm")
    engine = EngineArgs.from_cli_args(args)
    assert engine.served_model_name == ["a", "b"] and engine.served_model_names() == ["a", "b"]
    assert engine_args("--served-model-name", "one").served_model_name == "one"
    assert EngineArgs().served_model_names() == []
    assert args.enable_auto_tool_choice and args.trust_remote_code and args.log_requests
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "deepseek_r1")
    assert (args.log_level, args.generation_config) == ("debug", "vllm")
    vllm_flags.check_serve_args(args)
    # Last one wins, as argparse does; logging requests is off by default (vLLM's too).
    assert not serve_args("--enable-log-requests", "--disable-log-requests").log_requests
    assert not serve_args().log_requests
    assert serve_args("--generation-config", str(tmp_path)).generation_config == str(tmp_path)
    for command in ("generate", "chat"):
        extra = ["hi"] if command == "generate" else []
        assert parse_args([command, *extra, "--chat-template", "x.jinja",
                           "--trust-remote-code"]).chat_template == "x.jinja"


def test_chat_template_is_a_file_or_inline(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert vllm_flags.load_chat_template(str(tmp_path / "t.jinja")) == template
    assert vllm_flags.load_chat_template(template) == template
    assert vllm_flags.load_chat_template(None) is None


def test_generation_config_reads_the_models_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7,
         "do_sample": True, "bos_token_id": 1}))
    assert generation_defaults(str(tmp_path)) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert generation_defaults(str(tmp_path / "missing")) == {}
    assert generation_defaults(None) == {}


def test_generation_config_reads_gguf_sampling_metadata(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert generation_defaults(str(path)) == {"temperature": 0.5, "top_k": 40}


# ------------------------------------------------------------------- reasoning


@pytest.mark.parametrize("parser,tail,mode", [
    ("qwen3", "<|im_start|>assistant\n<think>\n", "open"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
    ("qwen3", "<|im_start|>assistant\n", "may_open"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "open"),
    ("deepseek_r1", "<｜Assistant｜>", "implicit"),
    ("deepseek_r1", "<think>a</think>b<｜Assistant｜><think>\n", "open"),
])
def test_thinking_mode_is_read_from_the_prompts_end(parser, tail, mode):
    assert thinking_mode(parser, tail) == mode


@pytest.mark.parametrize("text,mode,split", [
    ("I think.</think>\n\nAnswer.", "open", ("I think.", "\n\nAnswer.")),
    ("\n<think>x</think>y", "may_open", ("x", "y")),
    ("no thinking here", "may_open", (None, "no thinking here")),
    ("cut short while thinking", "open", ("cut short while thinking", None)),
    ("cut short while thinking", "implicit", ("cut short while thinking", None)),
    ("<think>a</think>b", "implicit", ("a", "b")),
    ("a</think>b", "closed", (None, "a</think>b")),
    ("a < b </thin", "open", ("a < b </thin", None)),
    ("<thin", "may_open", (None, "<thin")),
    ("</think>", "open", (None, None)),
])
def test_split_and_every_streamed_chunking_agree(text, mode, split):
    assert split_reasoning(text, mode) == split
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            splitter = ReasoningSplitter(mode)
            parts = [splitter.feed(text[:a]), splitter.feed(text[a:b]), splitter.feed(text[b:]),
                     splitter.finish()]
            reasoning = "".join(r for r, _ in parts) or None
            content = "".join(c for _, c in parts) or None
            assert (reasoning, content) == split, (a, b)


def test_thinking_grammar_puts_the_constraint_after_the_thinking():
    from llguidance import LLMatcher

    schema = StructuredOutputsParams(json={"type": "object"})
    for mode in ("open", "implicit", "may_open"):
        for answer in (schema.compiled, StructuredOutputsParams(choice=["a", "b"]).compiled,
                       None):
            assert LLMatcher.validate_grammar(thinking_grammar(answer, mode, 16, 3)) == ""
    assert thinking_grammar(schema.compiled, "closed") == schema.compiled
    assert constrain_after_thinking(None, "open", None) is None
    assert constrain_after_thinking(schema, "closed", 5) is schema
    bounded = constrain_after_thinking(schema, "open", 5, 3)
    assert "max_tokens=8" in bounded.compiled and bounded.json == schema.json


def test_generation_defaults_fill_only_what_a_request_leaves_out():
    """--generation-config's defaults reach the engine's SamplingParams, in process."""
    import asyncio

    import httpx

    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import ServerConfig, build_app
    from tests.test_server_async_engine import ScriptedEngine

    class Recording(ScriptedEngine):
        seen: list = []

        def add_request(self, request_id, prompt, params, arrival_time=None,
                        lora_request=None) -> None:
            self.seen.append(params)
            super().add_request(request_id, prompt, params, arrival_time)

    async def main():
        engine = Recording()
        aengine = AsyncLLMEngine(engine)
        defaults = {"temperature": 0.25, "top_k": 7, "max_tokens": 3}
        app = build_app(aengine, ServerConfig(sampling_defaults=defaults))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            r = (await c.post("/v1/completions", json={"prompt": [1, 2]})).json()
            assert r["usage"]["completion_tokens"] == 3  # the model's max_new_tokens
            await c.post("/v1/completions", json={"prompt": [1, 2], "temperature": 0.9,
                                                  "max_tokens": 2})
        await aengine.shutdown()
        return engine.seen

    first, second = asyncio.run(main())
    assert (first.temperature, first.top_k, first.max_tokens) == (0.25, 7, 3)
    assert (second.temperature, second.top_k, second.max_tokens) == (0.9, 7, 2)


@pytest.mark.slow
def test_generate_with_an_inline_chat_template():
    """--chat-template replaces the model's: this one ignores the messages altogether."""
    from tests.test_cli import SMALL_ENGINE, pagedllm

    result = pagedllm("generate", "Say nothing.", "--max-tokens", "3", "--chat-template",
                      "{{ 'The capital of France is' }}", *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("Paris")
