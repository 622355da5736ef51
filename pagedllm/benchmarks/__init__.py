"""Benchmarks: `pagedllm bench <workload>` prints numbers (never asserted by tests).

WORKLOAD_HELP is what `pagedllm bench --help` lists; it lives here, apart from the
workloads, so the help needs no torch. STANDALONE: the workloads that are a module of their
own here, with `main(argv) -> int`; the others are workloads.WORKLOADS.
"""

WORKLOAD_HELP = {
    "cpu": "the default model on the CPU vs transformers generate: output tokens/s",
    "nano": "Qwen3-0.6B shape, 256 sequences (nano-vllm's benchmark) vs transformers CB",
    "decode-8b": "Llama-3-8B shape, one request: decode speed vs memory bandwidth",
    "throughput-8b": "Llama-3-8B shape, 512 requests: output tokens/s",
    "prefix-8b": "requests sharing a 2,000-token prefix: prefix caching on vs off",
    "scheduler": "scheduler + block manager time per decode step, no model",
    "spec": "speculative decoding (n-gram, draft model) vs plain decoding: tok/s, acceptance",
    "structured": "structured output: per-token cost of grammar masks at batch 1 and 32",
    "sharegpt": "Llama-3-8B shape, a ShareGPT-like mix of 1,000 sampled requests: tok/s",
    "serve": "streaming requests against the server: concurrent clients or fixed "
             "request rates (TTFT, ITL)",
    "engine-state": "cost of one GET /v1/engine/state snapshot at 256 running sequences",
    "load": "LLM(), `pagedllm --help`, `generate` and `serve` to /health in fresh processes",
    "big-prompt": "a stream's inter-token latency while another client sends a huge prompt",
    "kernels": "Triton kernel checks at Llama-3-8B shapes on CUDA, then their timings",
    "fp8": "FP8 linears at Llama-3-8B shapes on CUDA: errors and times vs bf16",
    "tp-allreduce": "share of a tensor-parallel decode step's GPU time in NCCL kernels",
    "lora": "Llama-3-8B shape, 4 adapters of rank 16: throughput and batch-1 decode vs none",
    "quality": "int8 vs fp32 CPU activations on the default GGUF: multiple-choice accuracy "
               "through lm-eval against the server",
    "render": "not a workload: the Markdown of --out JSON files, for docs/benchmarks.md",
}

STANDALONE = {
    "serve": "serve_bench",
    "load": "load_bench",
    "engine-state": "engine_state_bench",
    "big-prompt": "big_prompt_bench",
    "kernels": "kernel_bench",
    "fp8": "fp8_bench",
    "tp-allreduce": "tp_allreduce_bench",
    "lora": "lora_bench",
    "quality": "quality_bench",
    "render": "render",
}
