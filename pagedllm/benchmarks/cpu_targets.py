"""`bench cpu`'s rows for quantized weights (issue 16): one stream, 16 streams and a
512-token prompt, for a GGUF file kept packed (--quantization gguf), the same file
dequantized (--dtype float32), and llama.cpp on the same file (llama-cpp-python, when it is
importable; never built or installed here).

Every engine runs the same token ids; the engines take turns, `repeats` times, and each row
is the median of its repeats, so that a noisy machine slows all of them alike.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Targets on 2 cores (issue 16): output tok/s of the decode rows.
TARGETS = {"1 stream": 60.0, "16 streams": 250.0}


@dataclass(frozen=True)
class Shapes:
    decode_tokens: int = 128  # new tokens per stream
    prompt_len: int = 32  # prompt of each decode stream
    streams: int = 16
    prefill_len: int = 512


# run(prompts, max_tokens) -> (output tokens, seconds)
Runner = Callable[[list[list[int]], int], tuple[int, float]]


def pagedllm_runner(llm) -> Runner:
    from pagedllm import SamplingParams

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start

    return run


def llama_cpp_runner(path: str, threads: int) -> tuple[Runner | None, str]:
    """llama.cpp through llama-cpp-python's high-level API (one sequence at a time), or None
    and why not."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, ("llama-cpp-python is not installed (`pip install llama-cpp-python` "
                      "builds llama.cpp): no llama.cpp rows")
    model = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=threads,
                  n_threads_batch=threads, verbose=False)

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        if len(prompts) != 1:
            raise ValueError("llama-cpp-python runs one sequence at a time")
        model.reset()
        start = time.perf_counter()
        if max_tokens == 1:  # a prefill row: evaluate the prompt
            model.eval(prompts[0])
            return 1, time.perf_counter() - start
        count = 0
        for _ in model.generate(prompts[0], temp=0.0, top_k=1, repeat_penalty=1.0):
            count += 1
            if count == max_tokens:
                break
        return count, time.perf_counter() - start

    return run, "llama.cpp via llama-cpp-python: 1 stream and prefill (its API decodes one " \
                "sequence at a time, so no 16-stream row)"


def measure(engines: dict[str, Runner], prompts: Callable[[int, int, int], list[list[int]]],
            shapes: Shapes, repeats: int, single_stream_only: set[str]) -> list[dict]:
    """Rows of {name, engine, workload, requests, input/output tokens, seconds, rate, rates}:
    each engine and workload `repeats` times in turns, the median time kept (rates: every
    repeat's). `prompts(n, length,
    seed)` gives n prompts of exactly `length` tokens."""
    workloads = [("1 stream", 1, shapes.prompt_len, shapes.decode_tokens),
                 (f"{shapes.streams} streams", shapes.streams, shapes.prompt_len,
                  shapes.decode_tokens),
                 (f"prefill {shapes.prefill_len}", 1, shapes.prefill_len, 1)]
    times: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for rep in range(repeats):
        for w, (label, n, length, new) in enumerate(workloads):
            batch = prompts(n, length, 1000 * rep + w)
            for name, run in engines.items():
                if n > 1 and name in single_stream_only:
                    continue
                times.setdefault((name, label), []).append(run(batch, new))
    rows = []
    for (name, label), results in times.items():
        _, n, length, new = next(w for w in workloads if w[0] == label)

        def rate(output: int, seconds: float) -> float:
            # the workload's rate: prompt tokens/s for prefill, output tokens/s otherwise
            return (n * length if new == 1 else output) / seconds

        output, seconds = sorted(results, key=lambda r: r[1])[len(results) // 2]
        rows.append({
            "name": f"{name} {label}", "engine": name, "workload": label, "num_requests": n,
            "input_tokens": n * length, "output_tokens": output, "elapsed_s": seconds,
            "output_tokens_per_s": output / seconds, "rate": rate(output, seconds),
            "rates": [round(rate(*r), 1) for r in results],  # each repeat's, in run order
        })
    return rows


def summarize(rows: list[dict], shapes: Shapes) -> dict:
    """Targets met or not, and the packed/dequantized ratios of each workload."""
    rate = {(r["engine"], r["workload"]): r["rate"] for r in rows}
    summary: dict = {"target_rows": "rate = output tok/s (decode rows), prompt tok/s "
                                    "(prefill rows), median of the repeats"}
    streams = f"{shapes.streams} streams"
    for label, target in (("1 stream", TARGETS["1 stream"]), (streams, TARGETS["16 streams"])):
        if ("gguf", label) in rate:
            summary[f"gguf {label} target {target:g} tok/s met"] = rate["gguf", label] >= target
    for label in ("1 stream", streams, f"prefill {shapes.prefill_len}"):
        if ("gguf", label) in rate and ("fp32", label) in rate:
            summary[f"gguf / fp32 {label}"] = rate["gguf", label] / rate["fp32", label]
        if ("gguf", label) in rate and ("llama.cpp", label) in rate:
            summary[f"gguf / llama.cpp {label}"] = rate["gguf", label] / rate["llama.cpp", label]
    return summary

