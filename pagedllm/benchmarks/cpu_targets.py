"""`bench cpu`'s rows for quantized weights (issues 16 and 34): one stream, 16 streams and a
512-token prompt, for a GGUF file kept packed (--quantization gguf) with int8 and with fp32
activations, the same file dequantized (--dtype float32), and llama.cpp on the same file
(llama-cpp-python, when it is importable; never built or installed here).

Every engine runs the same token ids; the engines take turns, `repeats` times, and each row
is the median of its repeats, so that a noisy machine slows all of them alike.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Targets on 2 cores (issue 16): output tok/s of the decode rows.
TARGETS = {"1 stream": 60.0, "16 streams": 250.0}
# Targets on 2 cores (issue 34): int8 activations' rate over llama.cpp's, same run.
PEER_TARGETS = {"1 stream": 1.7, "16 streams": 2.5, "prefill": 2.0}

# The pagedllm engines of the rows: LLM() options by name.
ENGINES = {
    "gguf int8": dict(quantization="gguf", dtype="auto", cpu_activations="int8"),
    "gguf": dict(quantization="gguf", dtype="auto", cpu_activations="fp32"),
    "fp32": dict(quantization=None, dtype="float32"),
}


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


def llama_cpp_runner(path: str, threads: int, shapes: Shapes) -> tuple[Runner | None, str]:
    """llama.cpp on the same GGUF file through llama-cpp-python's low-level API, or None and
    why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, ("llama-cpp-python is not installed: `pip install llama-cpp-python` "
                      "builds llama.cpp from source (CMAKE_ARGS=\"-DGGML_NATIVE=ON\" for this "
                      "CPU's instructions); no llama.cpp rows")
    per_seq = max(shapes.prompt_len + shapes.decode_tokens, shapes.prefill_len + 1)
    try:
        peer = LlamaCppBatched(path, threads, max_seqs=shapes.streams, ctx_per_seq=per_seq)
    except ValueError as exc:  # e.g. a file without the metadata llama.cpp needs
        return None, f"{exc}: no llama.cpp rows"
    return peer.run, ("llama.cpp via llama-cpp-python's low-level API, as its batched "
                      "example: every sequence's next token in one llama_batch per "
                      "llama_decode, greedy from each sequence's logits")


class LlamaCppBatched:
    """llama.cpp decoding many sequences at once: the prompts in llama_batch chunks of
    n_batch tokens (logits only for each prompt's last token), then one llama_decode per
    step carrying one token of every sequence, each sequence its own seq id and its own
    part of the KV cache (not unified: a sequence attends to its own cells only)."""

    n_batch = 512

    def __init__(self, path: str, threads: int, max_seqs: int, ctx_per_seq: int) -> None:
        import llama_cpp as C

        self.C = C
        self._quiet = C.llama_log_callback(lambda level, text, data: None)  # kept alive
        C.llama_log_set(self._quiet, None)
        C.llama_backend_init()
        self.model = C.llama_model_load_from_file(path.encode(), C.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        params = C.llama_context_default_params()
        params.n_ctx = max_seqs * ctx_per_seq
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        self.ctx = C.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise ValueError("llama.cpp could not make a context")
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.max_seqs = max_seqs
        self.batch = C.llama_batch_init(self.n_batch, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, seq id, wants logits) in n_batch chunks; the greedy next token
        of each entry that wants logits, in order."""
        import numpy as np

        C, b, picked = self.C, self.batch, []
        for at in range(0, len(entries), self.n_batch):
            chunk = entries[at:at + self.n_batch]
            for i, (token, pos, seq, logits) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
                b.seq_id[i][0], b.logits[i] = seq, logits
            b.n_tokens = len(chunk)
            if C.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            rows = sum(e[3] for e in chunk)
            if rows:
                logits = np.ctypeslib.as_array(C.llama_get_logits(self.ctx),
                                               shape=(rows, self.n_vocab))
                picked += logits.argmax(axis=1).tolist()
        return picked

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        if len(prompts) > self.max_seqs:
            raise ValueError(f"at most {self.max_seqs} sequences, got {len(prompts)}")
        self.C.llama_memory_clear(self.C.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        # The prompts: the first token of every sequence comes from its last prompt logits.
        tokens = self._decode([(t, pos, seq, pos == len(p) - 1)
                               for seq, p in enumerate(prompts) for pos, t in enumerate(p)])
        lengths = [len(p) for p in prompts]
        for step in range(max_tokens - 1):  # then one token of every sequence per call
            tokens = self._decode([(t, lengths[seq] + step, seq, True)
                                   for seq, t in enumerate(tokens)])
        return len(prompts) * max_tokens, time.perf_counter() - start


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
    """Targets met or not, and the ratios of each workload: packed (fp32 activations) over
    dequantized, and int8 activations over fp32 activations and over llama.cpp."""
    rate = {(r["engine"], r["workload"]): r["rate"] for r in rows}
    summary: dict = {"target_rows": "rate = output tok/s (decode rows), prompt tok/s "
                                    "(prefill rows), median of the repeats"}
    streams = f"{shapes.streams} streams"
    for label, target in (("1 stream", TARGETS["1 stream"]), (streams, TARGETS["16 streams"])):
        if ("gguf", label) in rate:
            summary[f"gguf {label} target {target:g} tok/s met"] = rate["gguf", label] >= target
    peer_targets = {"1 stream": PEER_TARGETS["1 stream"], streams: PEER_TARGETS["16 streams"],
                    f"prefill {shapes.prefill_len}": PEER_TARGETS["prefill"]}
    for label, target in peer_targets.items():
        for ours, theirs in (("gguf", "fp32"), ("gguf int8", "gguf"), ("gguf", "llama.cpp"),
                             ("gguf int8", "llama.cpp")):
            if (ours, label) in rate and (theirs, label) in rate:
                ratio = rate[ours, label] / rate[theirs, label]
                summary[f"{ours} / {theirs} {label}"] = ratio
                if (ours, theirs) == ("gguf int8", "llama.cpp"):
                    summary[f"gguf int8 / llama.cpp {label} target {target:g}x met"] = \
                        ratio >= target
    return summary
