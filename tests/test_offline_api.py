"""LLM's vLLM-compatible surface: prompt dicts, chat content parts and template options,
and vLLM's engine arguments."""
from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.llm import engine_args

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ------------------------------------------------------------------ prompt types


def test_prompt_dicts_are_their_text_or_token_ids(default_llm):
    tokenizer = default_llm.get_tokenizer()
    hello = tokenizer.encode("Hello")
    plain = default_llm.generate("Hello", GREEDY, use_tqdm=False)
    text = default_llm.generate({"prompt": "Hello"}, GREEDY, use_tqdm=False)
    tokens = default_llm.generate({"prompt_token_ids": hello}, GREEDY, use_tqdm=False)
    assert text[0].prompt == "Hello" and text[0].prompt_token_ids == hello
    assert tokens[0].prompt_token_ids == hello
    assert ids(text) == ids(tokens) == ids(plain)  # one prompt, the same step shapes


def test_a_list_mixes_every_prompt_type_in_order(default_llm):
    tokenizer = default_llm.get_tokenizer()
    prompts = ["The sky is", {"prompt": "Hello"}, {"prompt_token_ids": [1, 2, 3]}, [4, 5, 6],
               ("A tuple", "of prompts")[0]]
    outs = default_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        tokenizer.encode("The sky is"), tokenizer.encode("Hello"), [1, 2, 3], [4, 5, 6],
        tokenizer.encode("A tuple")]
    assert default_llm.generate([[7, 8], [9]], GREEDY, use_tqdm=False)[1].prompt_token_ids == [9]
    assert default_llm.generate([], GREEDY, use_tqdm=False) == []


@pytest.mark.parametrize("prompts,error,message", [
    (5, TypeError, "got int"),
    (None, TypeError, "got NoneType"),
    ([1.5], TypeError, r"prompts\[0\]: a prompt is a string, a list of token ids"),
    (["ok", b"bytes"], TypeError, r"prompts\[1\]: .* got bytes"),
    ([[1, "2"]], TypeError, r"prompts\[0\]: .* got list"),
    ({"prompt": 3}, TypeError, r"prompts\[0\]: 'prompt' must be a string, got int"),
    ({"prompt_token_ids": "1 2"}, TypeError, "'prompt_token_ids' must be a list of ints"),
    ({"prompt": "x", "multi_modal_data": {}}, ValueError,
     "unsupported prompt key 'multi_modal_data'"),
    ({"prompt": "x", "prompt_token_ids": [1]}, ValueError, "not both"),
    ({}, ValueError, "an empty prompt dict"),
])
def test_other_prompt_types_are_rejected(default_llm, prompts, error, message):
    with pytest.raises(error, match=message):
        default_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not default_llm.engine.has_unfinished_requests()


def test_sampling_params_of_the_wrong_type(default_llm):
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        default_llm.generate("Hi", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match="got a list holding dict"):
        default_llm.generate(["Hi"], [{"temperature": 0}], use_tqdm=False)


# -------------------------------------------------------------------------- chat


def test_chat_takes_text_content_parts(default_llm):
    as_string = [{"role": "user", "content": "Name a fruit.\nAnswer in one word."}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."},
                                             {"type": "text", "text": "Answer in one word."}]}]
    a, b = (default_llm.chat(m, GREEDY, use_tqdm=False)[0] for m in (as_string, as_parts))
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_chat_rejects_parts_other_than_text(default_llm):
    image = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: content part "
                                         r"'image_url' is not supported"):
        default_llm.chat(image, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
        default_llm.chat(["hello"], GREEDY, use_tqdm=False)


def test_chat_template_and_its_kwargs(default_llm):
    tokenizer = default_llm.get_tokenizer()
    template = ("{{ greeting }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    messages = [{"role": "user", "content": "Hi"}]
    out = default_llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template,
                           chat_template_kwargs={"greeting": "Welcome! "})[0]
    assert out.prompt_token_ids == tokenizer.encode("Welcome! [user] Hi\n[assistant]",
                                                    add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        default_llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": True})


def test_continue_final_message(default_llm):
    tokenizer = default_llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    out = default_llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False,
                           continue_final_message=True)[0]
    # The last message stays open: no end-of-turn token after it, no new assistant turn.
    assert tokenizer.decode(out.prompt_token_ids).endswith("The capital of France is")
    closed = default_llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert tokenizer.decode(closed.prompt_token_ids).rstrip().endswith("<|im_end|>")
    with pytest.raises(ValueError, match="cannot both be True"):
        default_llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)


def test_chat_takes_a_batch_of_conversations(default_llm):
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    outs = default_llm.chat(conversations, GREEDY, use_tqdm=False)
    singles = [default_llm.chat(c, GREEDY, use_tqdm=False)[0] for c in conversations]
    assert [o.prompt_token_ids for o in outs] == [s.prompt_token_ids for s in singles]


# --------------------------------------------------------------- engine arguments


def test_vllm_engine_arguments_with_a_meaning_here(tmp_path):
    args = engine_args(None, tensor_parallel_size=1, pipeline_parallel_size=1,
                       trust_remote_code=True, tokenizer_mode="auto", quantization=None,
                       kv_cache_memory_bytes=1 << 20, max_model_len=64)
    assert args.kv_cache_memory == 1 << 20 and args.max_model_len == 64
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "max_position_embeddings": 64,
    }))
    llm = LLM(str(config), load_format="dummy", tensor_parallel_size=1, trust_remote_code=False,
              kv_cache_memory_bytes=1 << 20, swap_space=0.001)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(data_parallel_size=2), ValueError,
     "data_parallel_size=2: data parallelism is not supported yet"),
    (dict(pipeline_parallel_size=4), ValueError, "pipeline parallelism is not supported yet"),
    (dict(tokenizer_mode="mistral"), ValueError, "tokenizer_mode='mistral' is not supported"),
    (dict(quantization="awq"), ValueError, "quantization must be one of gguf, fp8, got 'awq'"),
    (dict(cpu_offload_gb=4), TypeError, "unsupported engine argument 'cpu_offload_gb'"),
])
def test_other_engine_arguments_are_rejected_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(**kwargs)  # before anything is loaded
