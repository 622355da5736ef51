"""Run under torchrun by tests/test_tensor_parallel.py: the greedy outputs of
test_tensor_parallel's prompts with tensor_parallel_size = torchrun's world size, printed as
JSON by rank 0 (the other ranks serve steps inside LLM(...) and exit there)."""
from __future__ import annotations

import json
import os
import sys

from pagedllm import LLM, SamplingParams
from tests.test_tensor_parallel import ENGINE, MAX_TOKENS, token_prompts

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=int(os.environ["WORLD_SIZE"]), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(token_prompts(), params, use_tqdm=False)
    print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    llm.engine.shutdown()
