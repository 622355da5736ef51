"""Issue 16's CPU rows on another machine's CPU cores (the GPU host's, through `make
gpu-check`), where the default model's 98 MB GGUF cannot travel (the device tool carries
64 MiB). Timing does not depend on the weights' values, so a skeleton travels instead: the
file's header, tokenizer and fp32 tensors as they are, its quantized tensors zeroed
(gzip: ~1 MB). `run` fills those with random blocks of the same types (valid fp16 scales,
tests/quant_helpers.py) and times the packed path as `bench cpu`'s target rows do
(cpu_targets.measure), printing every repeat: on a shared machine one median hides too much.

    python scripts/cpu_targets_elsewhere.py skeleton .whl/smollm2-skeleton.gguf.gz
    taskset -c 2,3 env OMP_NUM_THREADS=2 python scripts/cpu_targets_elsewhere.py run \
        .whl/smollm2-skeleton.gguf.gz --repeats 3
"""
from __future__ import annotations

import argparse
import gzip
import os
import random
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pagedllm.kernels.cpu.quant import SUPPORTED_TYPES as QUANTIZED  # noqa: E402


def skeleton(src: str, dst: str) -> None:
    from pagedllm.loader.gguf_loader import open_gguf

    with open(src, "rb") as f:
        data = bytearray(f.read())
    for t in open_gguf(src).tensors:
        if t.tensor_type in QUANTIZED:
            data[t.data_offset:t.data_offset + t.n_bytes] = bytes(t.n_bytes)
    with gzip.open(dst, "wb", compresslevel=1) as f:
        f.write(data)


def fill(path: str) -> None:
    """Random blocks into every quantized tensor of the GGUF at `path`, in place."""
    from pagedllm.loader.gguf_loader import open_gguf
    from tests.quant_helpers import random_packed

    tensors = [t for t in open_gguf(path).tensors if t.tensor_type in QUANTIZED]
    data = np.memmap(path, mode="r+")
    for i, t in enumerate(tensors):
        cols, rows = (int(d) for d in t.shape[:2])  # GGUF lists the fastest dimension first
        data[t.data_offset:t.data_offset + t.n_bytes] = \
            random_packed(t.tensor_type, rows, cols, seed=i).reshape(-1)
    data.flush()


def run(skeleton_path: str, repeats: int) -> None:
    import torch

    from pagedllm import LLM
    from pagedllm.benchmarks import cpu_targets
    from pagedllm.benchmarks.workloads import text_prompts, warm_up

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        with gzip.open(skeleton_path, "rb") as f, open(path, "wb") as out:
            shutil.copyfileobj(f, out)
        fill(path)
        llm = LLM(model=path, quantization="gguf", device="cpu", kv_cache_memory=512 << 20)
        tokenizer = llm.get_tokenizer()
        warm_up(llm)

        def prompts(n: int, length: int, seed: int) -> list[list[int]]:
            return text_prompts(tokenizer, random.Random(seed), n, (length, length))

        rows = cpu_targets.measure({"gguf": cpu_targets.pagedllm_runner(llm)}, prompts,
                                   cpu_targets.Shapes(), repeats, set())
    print(f"cores {sorted(os.sched_getaffinity(0))}, {torch.get_num_threads()} threads")
    for r in rows:
        target = cpu_targets.TARGETS.get(r["workload"])
        unit = "prompt tok/s" if r["workload"].startswith("prefill") else "tok/s"
        print(f"{r['workload']}: " + ", ".join(f"{v:.1f}" for v in r["rates"])
              + f" {unit}, median {r['rate']:.1f}" + (f" (target {target:g})" if target else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("skeleton", help="write the skeleton of the default model (or --src)")
    s.add_argument("dst")
    s.add_argument("--src", default=None)
    r = sub.add_parser("run", help="time the packed path on random weights")
    r.add_argument("skeleton")
    r.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.cmd == "skeleton":
        from pagedllm.loader import default_model_path

        skeleton(args.src or str(default_model_path()), args.dst)
    else:
        run(args.skeleton, args.repeats)


if __name__ == "__main__":
    main()
