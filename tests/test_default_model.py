"""SmolLM2-135M-Instruct from the GGUF: our logits and greedy tokens vs transformers
loading the same file (the foundation issue's acceptance)."""
from __future__ import annotations

import torch

from pagedllm import SamplingParams
from tests.paged_helpers import (
    NEAR_TIE_VS_TRANSFORMERS, PagedRunner, assert_same_greedy, top_logprobs,
)

PROMPTS = [
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog because",
    "def add(a, b):\n    return",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]


def test_logits_match_transformers(default_llm, hf_reference):
    hf, tokenizer = hf_reference
    model = default_llm.engine.worker.model
    config = default_llm.engine.model_config
    runner = PagedRunner(model, config, num_blocks=64, block_size=16)
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    logits = runner.step(dict(enumerate(ids)))
    offset = 0
    with torch.no_grad():
        for prompt_ids in ids:
            ref = hf(torch.tensor([prompt_ids])).logits[0]
            ours = logits[offset: offset + len(prompt_ids)]
            offset += len(prompt_ids)
            assert (ours - ref).abs().max().item() <= 1e-3


def test_32_greedy_tokens_match_transformers(default_llm, hf_reference):
    hf, tokenizer = hf_reference
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outs = default_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=32, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
        ref = gen.sequences[0, ids.shape[1]:].tolist()
        # Both stop at the end-of-sequence token (kept in the ids) or after 32 tokens.
        assert_same_greedy(out.outputs[0].token_ids, ref,
                           top_logprobs(torch.cat(gen.logits)), NEAR_TIE_VS_TRANSFORMERS, prompt)
        assert out.prompt_token_ids == ids[0].tolist()
    assert any(len(o.outputs[0].token_ids) == 32 for o in outs)
