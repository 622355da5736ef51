"""`pagedllm bench lora`: LoRA's cost on a model's steps (issue 35's H200 check).

One engine (--enable-lora, --max-loras adapters of --rank on q/k/v/o/gate/up/down, random
weights written in PEFT's format to a temporary directory) runs the same workloads twice:
without adapters (base rows: CUDA graphs as usual) and with them.

  throughput  --num-requests random prompts, greedy, --output-len tokens each (ignore_eos),
              spread round-robin over the adapters: output tokens/s
  decode      one request of --decode-len tokens: tokens/s, with and without an adapter

It prints one JSON line per run and the ratios (with / without). Decode steps with adapter
rows replay the decode graphs' LoRA set; PAGEDLLM_LORA_GRAPHS=0 runs them eager (the A/B).
"""
from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from pagedllm.entrypoints.usage import Parser

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A PEFT LoRA directory for a Llama-shaped `config` (adapter_config.json +
    adapter_model.safetensors), A and B random (small, so activations stay finite)."""
    import torch
    from safetensors.torch import save_file

    head_dim = config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    h, inter = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    groups = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn"}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = (f"base_model.model.model.layers.{layer}.{groups.get(name, 'mlp')}."
                      f"{name}")
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                rank, fan_in, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                fan_out, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS), "bias": "none"}))


def timed(llm, prompts, params, loras) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str]) -> int:
    parser = Parser(prog="pagedllm bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--decode-len", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args(argv)

    from pagedllm import LLM, LoRARequest, SamplingParams

    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
              enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank,
              gpu_memory_utilization=args.gpu_memory_utilization)
    config = llm.engine.model_config
    root = Path(tempfile.mkdtemp(prefix="pagedllm-lora-bench-"))
    loras = []
    for i in range(args.max_loras):
        write_adapter(root / f"a{i}", config, args.rank, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    rng = random.Random(0)
    vocab = config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_len, ignore_eos=True)
    warm = prompts[:8]  # warm-up: graphs, kernels, the adapter path
    llm.generate(warm, SamplingParams(max_tokens=8), use_tqdm=False,
                 lora_request=loras[:1] * len(warm))
    spread = [loras[i % len(loras)] for i in range(len(prompts))]
    results = {
        "throughput_base": timed(llm, prompts, params, None),
        "throughput_lora": timed(llm, prompts, params, spread),
        "decode_base": timed(llm, prompts[:1], decode, None),
        "decode_lora": timed(llm, prompts[:1], decode, loras[:1]),
    }
    for name, result in results.items():
        print(json.dumps({"run": name, **result}))
    for kind in ("throughput", "decode"):
        ratio = results[f"{kind}_lora"]["tokens_per_s"] / results[f"{kind}_base"]["tokens_per_s"]
        print(json.dumps({"ratio": kind, "lora_over_base": round(ratio, 3)}))
    return 0
