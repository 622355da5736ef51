"""`pagedllm bench tp-allreduce`: where a tensor-parallel decode step's time goes.

Llama-3-8B preset (dummy bf16), batch-1 decode of 64 tokens after a 512-token prompt, eager:
the share of GPU kernel time spent in NCCL kernels on rank 0. With one GPU run it under
`torchrun --nproc-per-node 1` with --tp 1: one rank inside an NCCL group, the all-reduces
run for real.
"""
from __future__ import annotations

from pagedllm.entrypoints.usage import Parser


def main(argv: list[str]) -> int:
    parser = Parser(prog="pagedllm bench tp-allreduce",
                    description=__doc__.split(": ", 1)[1].split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size (default: 2)")
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams

    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", tensor_parallel_size=args.tp,
              enforce_eager=True, max_model_len=2048, num_scheduler_steps=1)
    prompt = [list(range(100, 612))]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
    total = nccl = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name != "CUDA":
            continue
        total += t
        nccl += t if "nccl" in e.key.lower() else 0
    print(f"allreduce-share: tp={args.tp}: NCCL kernels {nccl / 1e3:.1f} ms of "
          f"{total / 1e3:.1f} ms GPU kernel time on rank 0 ({nccl / max(total, 1):.1%}), "
          f"batch-1 decode of 64 tokens after a 512-token prompt, eager")
    llm.engine.shutdown()
    return 0
