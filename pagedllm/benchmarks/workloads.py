"""`pagedllm bench <workload>`: fixed workloads that print numbers, with their peers.

    cpu            the default model on the CPU vs transformers `generate` (target: >= 2x)
    nano           Qwen3-0.6B shape, 256 sequences (nano-vllm's benchmark) vs transformers CB
    decode-8b      Llama-3-8B shape, batch 1: tokens/s and the share of memory bandwidth
    throughput-8b  Llama-3-8B shape, 512 requests: output tokens/s (peer: transformers CB)
    prefix-8b      256 requests sharing a 2,000-token prefix, prefix caching on vs off
    scheduler      scheduler + block manager time per step with 256 running sequences
    spec           speculative decoding (n-gram, draft model) vs plain decoding, same prompts
    structured     structured output: masking's cost per token, constrained vs unconstrained
    sharegpt       Llama-3-8B shape, a ShareGPT-like mix of 1,000 sampled requests: tok/s

Each prints a table (last) and writes JSON to --out; --plot adds a PNG when matplotlib is
importable. Only generation is timed, never loading; every engine warms up first. The GPU
workloads run shrunk on a CPU with `--device cpu --model smollm2-135m --num-requests 2
--max-tokens 4`.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks import WORKLOAD_HELP, cpu_targets, machine, peers
from pagedllm.benchmarks.kernel_profile import kernel_profile, profile_summary
from pagedllm.benchmarks.scheduler_bench import run_scheduler_bench
from pagedllm.config import DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, resolve_dtype
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.usage import EXIT_USAGE, Parser, UsageError

# Real text for the `cpu` workload: a chat model sees text, not random ids. Prompts are
# windows of the tokenized passages at seeded offsets, so each has an exact length.
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens until it gleamed, and wrote the weather in a leather "
    "logbook: wind from the south-west, a falling glass, fishing boats back before dark.",
    "To bake a simple loaf, mix five hundred grams of flour with ten grams of salt, seven "
    "grams of yeast and about three hundred and fifty millilitres of warm water. Knead for "
    "ten minutes, let it rise for an hour, shape it, let it rise again, then bake it hot.",
    "A hash table stores values in an array of buckets. A hash function turns each key into "
    "an index; two keys that land in the same bucket collide, and the table resolves the "
    "collision by chaining entries in a list or by probing for the next free slot.",
    "Photosynthesis lets plants turn light into chemical energy. Chlorophyll absorbs red and "
    "blue light, water is split to release oxygen, and carbon dioxide from the air is fixed "
    "into sugars that feed the plant and, in the end, almost every animal on Earth.",
    "The committee met on Tuesday to discuss the new library. Members agreed that the "
    "reading room should face north for even light, that the children's section needed its "
    "own entrance, and that the budget for the roof could not be cut any further.",
    "Dear Maria, thank you for the postcard from Lisbon. The trams sound wonderful and I am "
    "jealous of the custard tarts. Here the rain has not stopped for a week, the garden is a "
    "marsh, and the cat refuses to go outside. Write again soon and tell me everything.",
    "In the eighteenth century, sailors could measure latitude from the height of the sun, "
    "but longitude needed an accurate clock. John Harrison spent decades building marine "
    "chronometers that kept time on a rolling ship, and navigation changed for good.",
    "Question: why does ice float on water? Answer: when water freezes, hydrogen bonds hold "
    "its molecules in an open hexagonal lattice, which takes up more room than the liquid. "
    "Ice is therefore less dense than water, and lakes freeze from the top down.",
]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    needs_cuda: bool
    num_requests: int
    input_len: tuple[int, int]  # prompt tokens (prefix-8b: each request's own tokens)
    output_len: tuple[int, int]
    model: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    peer: bool = False


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("cpu", "default model on the CPU vs transformers generate", False, 32,
             (16, 256), (64, 64), peer=True),
    Workload("nano", "Qwen3-0.6B shape, random prompts, sampled outputs of random length",
             True, 256, (100, 1024), (100, 1024), "qwen3-0.6b", "dummy", "bfloat16", peer=True),
    Workload("decode-8b", "Llama-3-8B shape, one request: decode speed vs memory bandwidth",
             True, 1, (128, 128), (512, 512), "llama-3-8b", "dummy", "bfloat16"),
    Workload("throughput-8b", "Llama-3-8B shape, many requests: output tokens/s", True, 512,
             (256, 1024), (256, 256), "llama-3-8b", "dummy", "bfloat16"),
    Workload("prefix-8b", "requests sharing a long prefix: prefix caching on vs off", True,
             256, (50, 50), (32, 32), "llama-3-8b", "dummy", "bfloat16"),
    Workload("scheduler", "scheduler + block manager time per decode step, no model", False,
             256, (128, 128), (1, 1)),
    Workload("spec", "speculative decoding vs plain decoding on prompts that repeat or "
             "lightly edit a passage: tokens/s, acceptance, identical text", False, 4,
             (256, 256), (128, 128)),
    Workload("structured", "structured output: per-token cost of the grammar masks, "
             "constrained vs unconstrained batches", False, 32, (16, 64), (64, 64)),
    Workload("sharegpt", "Llama-3-8B shape, a ShareGPT-like mix: lognormal prompt and output "
             "lengths, T=0.8, top_p=0.95, every output run to its length: output and total "
             "tokens/s", True, 1000, (4, 2048), (4, 1024), "llama-3-8b", "dummy", "bfloat16"),
]}


# ----------------------------------------------------------------------------- options


def build_parser(workload: Workload) -> argparse.ArgumentParser:
    w = workload
    p = Parser(prog=f"pagedllm bench {w.name}", description=w.description)
    # vLLM's benchmarks call it --num-prompts; sharegpt takes both spellings
    names = ["--num-requests", "--num-prompts"] if w.name == "sharegpt" else ["--num-requests"]
    p.add_argument(*names, dest="num_requests", type=int, default=w.num_requests,
                   help=f"requests (scheduler: running sequences) (default {w.num_requests})")
    p.add_argument("--min-input-len", type=int, default=None,
                   help=f"shortest prompt in tokens (default {w.input_len[0]})")
    p.add_argument("--max-input-len", type=int, default=None,
                   help=f"longest prompt in tokens (default {w.input_len[1]})")
    p.add_argument("--min-tokens", type=int, default=None,
                   help=f"fewest output tokens (default {w.output_len[0]})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"most output tokens (default {w.output_len[1]}); alone, it also "
                   "lowers --min-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=f"JSON file (default bench-results/{w.name}.json)")
    p.add_argument("--plot", action="store_true", help="also write a PNG bar chart")
    if w.name == "scheduler":
        p.add_argument("--num-steps", type=int, default=200)
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false")
        return p
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peer", dest="peer", action="store_true", default=w.peer,
                      help="also run transformers on the same inputs" +
                      (" (default)" if w.peer else ""))
    peer.add_argument("--no-peer", dest="peer", action="store_false")
    p.add_argument("--model", default=w.model, help=f"default: {w.model or 'SmolLM2-135M GGUF'}")
    p.add_argument("--load-format", default=w.load_format,
                   choices=LOAD_FORMATS)
    p.add_argument("--dtype", default=w.dtype, choices=DTYPES)
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="gguf: a GGUF's blocks kept packed (the CPU's default for GGUF files); "
                   "fp8: FP8 weights on CUDA")
    p.add_argument("--device", default="cuda" if w.needs_cuda else "cpu")
    p.add_argument("--device-map", default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs (ranks) the model is split over (default 1)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode steps per scheduling step (default: 8 on CUDA, 1 on CPU)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the host's work with the device's (default: on CUDA only)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: the engine's, sized by the device (the start-up log says)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: the engine's, sized by the device")
    p.add_argument("--kv-cache-memory", default=None, help="bytes for the KV cache on the CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="fp8 (= fp8_e4m3): the paged KV cache in FP8 E4M3 on CUDA")
    if w.name == "cpu":
        p.add_argument("--repeats", type=int, default=3,
                       help="pairs of runs, pagedllm then transformers, each pair on its "
                       "own prompts (default 3); the ratio is the median of the pairs'")
        targets = p.add_mutually_exclusive_group()
        targets.add_argument("--targets", dest="targets", action="store_true", default=True,
                             help="also time 1 stream, 16 streams and a 512-token prefill "
                             "with the GGUF packed (int8 and fp32 activations), dequantized "
                             "and in llama.cpp (default)")
        targets.add_argument("--no-targets", dest="targets", action="store_false")
        p.add_argument("--target-tokens", type=int, default=128,
                       help="new tokens per stream of the target rows (default 128)")
        p.add_argument("--target-streams", type=int, default=16)
        p.add_argument("--prefill-len", type=int, default=512)
    if w.name in ("nano", "sharegpt"):
        p.add_argument("--profile", action="store_true",
                       help="also record the timed run's CUDA kernels and print their time by "
                       "kind and the GPU-busy share (the profiler slows the run a little)")
    if w.name == "nano":
        p.add_argument("--temperature", type=float, default=0.6)
        p.add_argument("--peer-max-tokens", type=int, default=None,
                       help="the fixed output length of the like-for-like comparison "
                       "(default: the middle of the output range)")
    if w.name == "prefix-8b":
        p.add_argument("--prefix-len", type=int, default=2000)
    if w.name == "sharegpt":
        p.add_argument("--temperature", type=float, default=0.8)
        p.add_argument("--top-p", type=float, default=0.95)
        p.add_argument("--mean-input-len", type=float, default=SHAREGPT_MEAN_INPUT,
                       help="mean of the lognormal prompt lengths before clipping to "
                       f"[--min-input-len, --max-input-len] (default {SHAREGPT_MEAN_INPUT:g})")
        p.add_argument("--mean-output-len", type=float, default=SHAREGPT_MEAN_OUTPUT,
                       help="mean of the lognormal output lengths before clipping to "
                       f"[--min-tokens, --max-tokens] (default {SHAREGPT_MEAN_OUTPUT:g})")
    if w.name == "spec":
        p.add_argument("--method", default="ngram", choices=["ngram", "draft_model", "both"],
                       help="the proposer(s) timed against plain decoding (default ngram)")
        p.add_argument("--num-speculative-tokens", type=int, default=4)
        p.add_argument("--prompt-lookup-min", type=int, default=1)
        p.add_argument("--prompt-lookup-max", type=int, default=4)
        p.add_argument("--draft-model", default=None,
                       help="the draft model (default: --model itself: draft = target, every "
                       "proposal accepted, the mechanism's ceiling)")
        p.add_argument("--draft-load-format", default=None, choices=LOAD_FORMATS,
                       help="default: --load-format")
        p.add_argument("--streams", type=int, default=1,
                       help="requests generated at once (default 1: single stream, each "
                       "request alone)")
        p.add_argument("--disable-by-batch-size", type=int, default=None,
                       help="no speculation in a step with more running sequences")
    if w.name == "structured":
        p.add_argument("--batch-sizes", default="1,32",
                       help="comma list of batch sizes, each run constrained and not "
                       "(default 1,32); --num-requests is unused")
        p.add_argument("--constrained-fraction", type=float, default=1.0,
                       help="share of each batch's requests that are constrained (default 1)")
        p.add_argument("--constraint", choices=["text", "json"], default="text",
                       help="text: a regex of free text that never ends (most of the "
                       "vocabulary allowed every step: masks' costly case; outputs run to "
                       "--max-tokens); json: a nested JSON schema (outputs end with the JSON)")
        p.add_argument("--tokenizer", default=None,
                       help="tokenizer directory (a random-weight model has none of its own)")
        p.add_argument("--temperature", type=float, default=1.0)
        p.add_argument("--repeats", type=int, default=2,
                       help="runs of each kind per batch size, alternating which goes first; "
                       "the median time counts (default 2)")
    return p


def _resolve_range(name: str, lo: int | None, hi: int | None, default: tuple[int, int]
                   ) -> tuple[int, int]:
    """An override of one end moves the other end only when that one was not given."""
    for end, value in (("min", lo), ("max", hi)):
        if value is not None and value < 1:
            raise UsageError(f"--{end}-{name} must be at least 1, got {value}")
    low = default[0] if lo is None else lo
    high = default[1] if hi is None else hi
    if lo is None:
        low = min(low, high)
    if hi is None:
        high = max(high, low)
    if low > high:
        raise UsageError(f"--min-{name} ({low}) is above --max-{name} ({high})")
    return low, high


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`[workload, *options]` -> options with `workload`, `input_len` and `output_len` set."""
    if not argv or argv[0].startswith("-"):
        raise UsageError(f"name a workload: {', '.join(WORKLOADS)}")
    workload = WORKLOADS.get(argv[0])
    if workload is None:
        raise UsageError(
            f"unknown benchmark workload {argv[0]!r}; choose from: "
            f"{', '.join(WORKLOAD_HELP)}"
        )
    args = build_parser(workload).parse_args(argv[1:])
    args.workload = workload.name
    args.input_len = _resolve_range("input-len", args.min_input_len, args.max_input_len,
                                    workload.input_len)
    args.output_len = _resolve_range("tokens", args.min_tokens, args.max_tokens,
                                     workload.output_len)
    if args.num_requests < 1:
        raise UsageError(f"--num-requests must be at least 1, got {args.num_requests}")
    for name in ("num_steps", "prefix_len", "peer_max_tokens", "repeats", "target_tokens",
                 "target_streams", "prefill_len", "num_speculative_tokens", "streams",
                 "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    device = getattr(args, "device", "cpu")
    if getattr(args, "profile", False) and not device.startswith("cuda"):
        raise UsageError(f"--profile records CUDA kernels; this run is on {device}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(
            f"workload {workload.name!r} runs on CUDA, which is not available here; to try it "
            "on the CPU pass --device cpu and a small size, e.g. --model smollm2-135m "
            "--num-requests 2 --max-tokens 4"
        )
    args.out = Path(args.out or f"bench-results/{workload.name}.json")
    return args


# ----------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    """One timed generation run: a row of the table."""

    name: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d["output_tokens_per_s"] = self.output_tokens_per_s
        d["requests_per_s"] = self.num_requests / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return {**d, **extra}


@dataclass
class Report:
    workload: str
    description: str
    runs: list[RunResult | dict[str, Any]]
    summary: dict[str, Any]
    columns: list[tuple[str, str, str]]  # (key, header, format) of the table


def random_prompts(rng: random.Random, n: int, lengths: tuple[int, int], vocab: int = 10000
                   ) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def text_prompts(tokenizer, rng: random.Random, n: int, lengths: tuple[int, int]
                 ) -> list[list[int]]:
    """Windows of exact length over the tokenized PASSAGES, at seeded offsets."""
    ids = tokenizer.encode("\n\n".join(PASSAGES), add_special_tokens=False)
    stream = ids * (lengths[1] // len(ids) + 2)
    prompts = []
    for _ in range(n):
        length = rng.randint(*lengths)
        start = rng.randrange(len(ids))
        prompts.append(stream[start:start + length])
    return prompts


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    kwargs = dict(
        load_format=args.load_format, dtype=args.dtype, quantization=args.quantization,
        device=args.device,
        device_map=args.device_map, seed=args.seed, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        num_scheduler_steps=args.num_scheduler_steps, async_scheduling=args.async_scheduling,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    kwargs.update(overrides)
    return kwargs


# What the last engine make_llm built resolved (batch limits sized by the device unless
# given, the KV cache it fit): report_dict records it, so pages from different devices compare.
ENGINE_LIMITS: dict[str, int] = {}


def make_llm(args: argparse.Namespace, **overrides: Any):
    llm = LLM(model=args.model, **engine_kwargs(args, **overrides))
    engine = llm.engine
    ENGINE_LIMITS.update(max_num_seqs=engine.scheduler_config.max_num_seqs,
                         max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens,
                         kv_cache_tokens=engine.info.num_gpu_blocks * engine.block_size)
    return llm


def free_memory() -> None:
    """After `del` of an engine or model: give its memory back for the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def warm_up(llm, vocab: int = 10000) -> None:
    """Compile kernels and run each path once before timing: prefill, decode, greedy, sampled."""
    rng = random.Random(12345)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (17, 40)]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    sampled = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8)
    llm.generate(prompts, [greedy, sampled], use_tqdm=False)


def timed_generate(llm, name: str, prompts: list[list[int]], params: list) -> tuple[RunResult, list]:
    _sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - start
    result = RunResult(name, len(prompts), sum(len(p) for p in prompts),
                       sum(len(o.outputs[0].token_ids) for o in outs), elapsed)
    return result, outs


def run_peer(name: str, fn: Callable[[], Any], num_requests: int, input_tokens: int
             ) -> RunResult | dict[str, Any]:
    """A peer that fails leaves a note in the report instead of losing pagedllm's numbers."""
    try:
        peer = fn()
    except Exception as exc:  # noqa: BLE001 - any failure of the third-party peer
        print(f"warning: peer {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"name": name, "error": f"{type(exc).__name__}: {exc}"}
    return RunResult(name, num_requests, input_tokens, peer.output_tokens, peer.elapsed_s)


def _ratio(a: RunResult | dict, b: RunResult | dict) -> float | None:
    if not (isinstance(a, RunResult) and isinstance(b, RunResult)) or not b.output_tokens_per_s:
        return None
    return a.output_tokens_per_s / b.output_tokens_per_s


THROUGHPUT_COLUMNS = [
    ("name", "run", "{}"), ("num_requests", "requests", "{:d}"),
    ("input_tokens", "input tok", "{:d}"), ("output_tokens", "output tok", "{:d}"),
    ("elapsed_s", "time (s)", "{:.2f}"), ("output_tokens_per_s", "output tok/s", "{:.1f}"),
]


# ----------------------------------------------------------------------------- workloads


def _continuous_batching_peer(args: argparse.Namespace, prompts: list[list[int]],
                              max_new_tokens: int) -> Callable[[], peers.PeerRun]:
    """transformers' continuous batching on the same prompts, loaded only when it runs."""
    def peer() -> peers.PeerRun:
        model = peers.load_peer_model(args.model, args.load_format,
                                      resolve_dtype(args.dtype, args.device), args.device,
                                      attn_implementation="paged|sdpa")
        try:
            return peers.hf_generate_batch(model, prompts, max_new_tokens)
        finally:
            del model
            free_memory()

    return peer


def bench_cpu(args: argparse.Namespace) -> Report:
    """pagedllm and transformers' `generate` on the same prompts, in `--repeats` pairs run
    back to back with both engines loaded: on a noisy machine each pair runs under the same
    conditions. Each pair has its own prompts (seed, seed + 1, ...), so no run reuses an
    earlier run's prefix cache. The ratio is the median of the pairs' ratios."""
    llm = make_llm(args)
    tokenizer = llm.get_tokenizer()
    kind = ("real text (tokenized windows of fixed passages)" if tokenizer is not None
            else "random token ids in [0, 10000)")
    max_tokens = args.output_len[1]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm_up(llm)
    peer_model: list[torch.nn.Module] = []

    def peer(prompts: list[list[int]]) -> peers.PeerRun:
        if not peer_model:
            peer_model.append(peers.load_peer_model(
                args.model, args.load_format, resolve_dtype(args.dtype, args.device), args.device))
        return peers.hf_generate(peer_model[0], prompts, max_tokens)

    runs: list[RunResult | dict] = []
    ratios: list[float] = []
    for i in range(args.repeats):
        rng = random.Random(args.seed + i)
        prompts = (text_prompts(tokenizer, rng, args.num_requests, args.input_len)
                   if tokenizer is not None
                   else random_prompts(rng, args.num_requests, args.input_len))
        suffix = f" #{i + 1}" if args.repeats > 1 else ""
        ours, _ = timed_generate(llm, "pagedllm" + suffix, prompts, [params] * len(prompts))
        runs.append(ours)
        if args.peer and not any(isinstance(r, dict) for r in runs):  # stop after a failure
            theirs = run_peer("transformers generate" + suffix, lambda: peer(prompts),
                              len(prompts), ours.input_tokens)
            runs.append(theirs)
            if isinstance(theirs, RunResult):
                ratios.append(_ratio(ours, theirs))
    quantization = llm.engine.worker.quantization
    llm.engine.shutdown()  # tensor-parallel ranks, if any
    del llm
    peer_model.clear()
    free_memory()
    summary = {"prompts": kind, "output_len": max_tokens, "target_ratio": 2.0,
               "num_threads": torch.get_num_threads(), "repeats": args.repeats,
               "pagedllm_weights": quantization or args.dtype}
    if args.peer and len(ratios) == args.repeats:
        summary["ratio"] = ratio = statistics.median(ratios)
        if len(ratios) > 1:
            summary["ratios_per_pair"] = ", ".join(f"{r:.3f}" for r in ratios)
        summary["meets_target"] = ratio >= 2.0
    columns = THROUGHPUT_COLUMNS
    if args.targets:
        target_rows, notes = _cpu_target_rows(args)
        runs += target_rows
        summary.update(notes)
        columns = THROUGHPUT_COLUMNS + [("rate", "target rate", "{:.1f}")]
    return Report("cpu", WORKLOADS["cpu"].description, runs, summary, columns)


def _cpu_target_rows(args: argparse.Namespace) -> tuple[list[dict], dict[str, Any]]:
    """Issues 16 and 34's rows (benchmarks/cpu_targets.py): the GGUF kept packed (int8 and
    fp32 activations), dequantized, and in llama.cpp when llama-cpp-python is importable."""
    model = args.model
    if args.load_format not in ("auto", "gguf") or (model and not str(model).endswith(".gguf")):
        return [], {"targets": "skipped: the target rows compare a GGUF file's packed and "
                               "dequantized weights"}
    from pagedllm.loader import default_model_path

    kv = args.kv_cache_memory or str(512 << 20)
    engines = {name: make_llm(args, kv_cache_memory=kv, **options)
               for name, options in cpu_targets.ENGINES.items()}
    tokenizer = engines["gguf"].get_tokenizer()

    def prompts(n: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        if tokenizer is None:
            return random_prompts(rng, n, (length, length))
        return text_prompts(tokenizer, rng, n, (length, length))

    runners = {name: cpu_targets.pagedllm_runner(llm) for name, llm in engines.items()}
    for llm in engines.values():
        warm_up(llm)
    shapes = cpu_targets.Shapes(decode_tokens=args.target_tokens, streams=args.target_streams,
                                prefill_len=args.prefill_len)
    peer, note = cpu_targets.llama_cpp_runner(model or default_model_path(),
                                              torch.get_num_threads(), shapes)
    if peer is not None:
        runners["llama.cpp"] = peer
    rows = cpu_targets.measure(runners, prompts, shapes, args.repeats, set())
    del engines, runners
    free_memory()
    return rows, {**cpu_targets.summarize(rows, shapes), "llama.cpp": note}


def bench_nano(args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, args.num_requests, args.input_len)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True,
                             max_tokens=rng.randint(*args.output_len)) for _ in prompts]
    input_tokens = sum(len(p) for p in prompts)
    fixed_len = args.peer_max_tokens or (args.output_len[0] + args.output_len[1]) // 2
    llm = make_llm(args)
    warm_up(llm)
    with kernel_profile(args.profile) as kernels:
        sampled, _ = timed_generate(llm, f"pagedllm (T={args.temperature}, random out len)",
                                    prompts, params)
    runs: list[RunResult | dict] = [sampled]
    summary: dict[str, Any] = {"prompts": "random token ids in [0, 10000)"}
    summary.update(profile_summary(kernels, sampled.elapsed_s))
    if args.peer:
        greedy = SamplingParams(temperature=0.0, max_tokens=fixed_len, ignore_eos=True)
        fixed, _ = timed_generate(llm, f"pagedllm (greedy, {fixed_len} out)", prompts,
                                  [greedy] * len(prompts))
        runs.append(fixed)
    llm.engine.shutdown()  # tensor-parallel ranks, if any
    del llm
    free_memory()
    if args.peer:
        runs.append(run_peer(f"transformers CB (greedy, {fixed_len} out)",
                             _continuous_batching_peer(args, prompts, fixed_len), len(prompts),
                             input_tokens))
        summary["peer_output_len"] = fixed_len
        summary["ratio"] = _ratio(runs[1], runs[2])
    return Report("nano", WORKLOADS["nano"].description, runs, summary, THROUGHPUT_COLUMNS)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10
                           ) -> float:
    """Bytes per second of a large device-to-device copy (read + write), median of repeats."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: all parameters and buffers (quantized
    weights are buffers), except an untied input embedding, of which a step reads only one
    row per token."""
    tensors = list(model.parameters()) + list(model.buffers())
    total = sum(t.numel() * t.element_size() for t in tensors)
    embedding = getattr(getattr(model, "embed_tokens", None), "weight", None)
    head = getattr(model, "lm_head", None)  # None: tied to the embedding, read in full
    if head is not None and embedding is not None and head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def _timed_greedy_run(args: argparse.Namespace) -> tuple[Any, RunResult, list, list[list[int]]]:
    """decode-8b and throughput-8b: random prompts, greedy, every output full length, timed
    after a warm-up. Returns the engine (for its stats and model), the result, the outputs
    and the prompts."""
    prompts = random_prompts(random.Random(args.seed), args.num_requests, args.input_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len[1], ignore_eos=True)
    llm = make_llm(args)
    warm_up(llm)
    result, outs = timed_generate(llm, "pagedllm", prompts, [params] * len(prompts))
    return llm, result, outs, prompts


def bench_decode(args: argparse.Namespace) -> Report:
    llm, result, outs, _ = _timed_greedy_run(args)
    # Decode speed per request: tokens after the first over the time between first and last.
    rates = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if n > 1 and m.last_token_time > m.first_token_time:
            rates.append((n - 1) / (m.last_token_time - m.first_token_time))
    decode_rate = statistics.fmean(rates) if rates else 0.0
    wbytes = weight_bytes_per_token(llm.engine.worker.model)
    device = llm.engine.worker.device_map.layer_devices[0]
    llm.engine.shutdown()  # tensor-parallel ranks, if any
    del llm
    free_memory()
    nbytes = (1 << 30) if device.type == "cuda" else (1 << 26)
    bandwidth = measure_copy_bandwidth(device, nbytes)
    share = wbytes * decode_rate / bandwidth
    result.extra.update(decode_tokens_per_s=decode_rate, ms_per_token=1000 / decode_rate
                        if decode_rate else None, bandwidth_share=share)
    summary = {"weight_bytes": wbytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
               "decode_tokens_per_s": decode_rate, "bandwidth_share": share,
               "achieved_gb_s": wbytes * decode_rate / 1e9}
    columns = THROUGHPUT_COLUMNS + [("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
                                    ("ms_per_token", "ms/token", "{:.2f}"),
                                    ("bandwidth_share", "of bandwidth", "{:.1%}")]
    return Report("decode-8b", WORKLOADS["decode-8b"].description, [result], summary, columns)


def bench_throughput(args: argparse.Namespace) -> Report:
    llm, ours, _, prompts = _timed_greedy_run(args)
    preemptions = llm.engine.get_stats().num_preemptions
    llm.engine.shutdown()  # tensor-parallel ranks, if any
    del llm
    free_memory()
    runs: list[RunResult | dict] = [ours]
    summary: dict[str, Any] = {"prompts": "random token ids in [0, 10000)",
                               "num_preemptions": preemptions}
    if args.peer:
        peer = _continuous_batching_peer(args, prompts, args.output_len[1])
        runs.append(run_peer("transformers CB", peer, len(prompts), ours.input_tokens))
        summary["ratio"] = _ratio(runs[0], runs[1])
    return Report("throughput-8b", WORKLOADS["throughput-8b"].description, runs, summary,
                  THROUGHPUT_COLUMNS)


# `sharegpt`: lengths like ShareGPT's conversations (a long right tail), drawn from a seed
# so every engine and every run sees the same mix.
SHAREGPT_MEAN_INPUT = 290.0
SHAREGPT_MEAN_OUTPUT = 220.0
SHAREGPT_SIGMA_INPUT = 1.0
SHAREGPT_SIGMA_OUTPUT = 0.9


def lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float,
                      bounds: tuple[int, int]) -> list[int]:
    """n lengths from a lognormal of the given mean (before clipping) clipped to bounds."""
    mu = math.log(mean) - sigma * sigma / 2
    lo, hi = bounds
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def length_stats(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)
    return {"mean": statistics.fmean(ordered), "p50": ordered[len(ordered) // 2],
            "p99": ordered[min(len(ordered) - 1, (99 * len(ordered)) // 100)],
            "max": ordered[-1], "total": sum(ordered)}


def bench_sharegpt(args: argparse.Namespace) -> Report:
    """The mix users compare engines on: seeded lognormal prompt and output lengths, random
    token ids, sampled at --temperature and --top-p, ignore_eos so each output runs to its
    drawn length."""
    if args.mean_input_len < 1 or args.mean_output_len < 1:
        raise UsageError("--mean-input-len and --mean-output-len must be at least 1")
    rng = random.Random(args.seed)
    n = args.num_requests
    input_lens = lognormal_lengths(rng, n, args.mean_input_len, SHAREGPT_SIGMA_INPUT,
                                   args.input_len)
    output_lens = lognormal_lengths(rng, n, args.mean_output_len, SHAREGPT_SIGMA_OUTPUT,
                                    args.output_len)
    prompts = [[rng.randrange(10000) for _ in range(length)] for length in input_lens]
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, ignore_eos=True,
                             max_tokens=length) for length in output_lens]
    llm = make_llm(args)
    warm_up(llm)
    # and the mix's own sampling (top-p's kernels compile here, not in the timed run)
    mix = SamplingParams(temperature=args.temperature, top_p=args.top_p, ignore_eos=True,
                         max_tokens=4)
    llm.generate(random_prompts(random.Random(args.seed + 1), 2, (16, 48)), mix, use_tqdm=False)
    with kernel_profile(args.profile) as kernels:
        result, _ = timed_generate(llm, "pagedllm", prompts, params)
    preemptions = llm.engine.get_stats().num_preemptions
    llm.engine.shutdown()  # tensor-parallel ranks, if any
    del llm
    free_memory()
    total = result.input_tokens + result.output_tokens
    result.extra["total_tokens_per_s"] = total / result.elapsed_s if result.elapsed_s else 0.0
    summary: dict[str, Any] = {
        "prompts": "random token ids in [0, 10000)",
        "input_len": length_stats(input_lens), "output_len": length_stats(output_lens),
        "output_tokens_per_s": result.output_tokens_per_s,
        "total_tokens_per_s": result.extra["total_tokens_per_s"],
        "num_preemptions": preemptions,
        "sampler": os.environ.get("PAGEDLLM_SAMPLER", "rejection"),
    }
    summary.update(profile_summary(kernels, result.elapsed_s))
    columns = THROUGHPUT_COLUMNS + [("total_tokens_per_s", "total tok/s", "{:.1f}")]
    return Report("sharegpt", WORKLOADS["sharegpt"].description, [result], summary, columns)


def bench_prefix(args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(10000) for _ in range(args.prefix_len)]
    prompts = [prefix + p for p in random_prompts(rng, args.num_requests, args.input_len)]
    n_out = args.output_len[1]
    params = [SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)] * len(prompts)
    runs: list[RunResult | dict] = []
    for caching in (True, False):
        llm = make_llm(args, enable_prefix_caching=caching)
        warm_up(llm)  # random prompts: the shared prefix is not cached before timing
        result, outs = timed_generate(llm, f"prefix caching {'on' if caching else 'off'}",
                                      prompts, params)
        cached = sum(o.num_cached_tokens for o in outs)
        result.extra.update(
            cached_prompt_tokens=cached,
            prefix_hit_rate=cached / result.input_tokens,
            total_tokens_per_s=(result.input_tokens + result.output_tokens) / result.elapsed_s,
        )
        runs.append(result)
        llm.engine.shutdown()  # tensor-parallel ranks, if any
        del llm
        free_memory()
    on, off = runs
    lo, hi = args.input_len
    summary = {"prefix_len": args.prefix_len, "own_tokens": str(lo) if lo == hi else f"{lo}-{hi}",
               "speedup": off.elapsed_s / on.elapsed_s if on.elapsed_s else None}
    columns = THROUGHPUT_COLUMNS + [("total_tokens_per_s", "total tok/s", "{:.1f}"),
                                    ("prefix_hit_rate", "prefix hits", "{:.1%}")]
    return Report("prefix-8b", WORKLOADS["prefix-8b"].description, runs, summary, columns)


def bench_scheduler(args: argparse.Namespace) -> Report:
    if args.input_len[0] != args.input_len[1]:
        raise UsageError("the scheduler workload takes one prompt length: "
                              "give --min-input-len and --max-input-len the same value")
    result = run_scheduler_bench(
        num_seqs=args.num_requests, prompt_len=args.input_len[0], num_steps=args.num_steps,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
    )
    row = {"name": "schedule + update", **result.to_dict()}
    columns = [("name", "step", "{}"), ("num_seqs", "running seqs", "{:d}"),
               ("num_steps", "steps", "{:d}"), ("mean_us", "mean (us)", "{:.1f}"),
               ("p50_us", "p50 (us)", "{:.1f}"), ("p99_us", "p99 (us)", "{:.1f}"),
               ("schedule_mean_us", "schedule() mean (us)", "{:.1f}"),
               ("build_mean_us", "StepBatch build (us)", "{:.1f}")]
    summary = {"enable_prefix_caching": args.enable_prefix_caching, "block_size": args.block_size}
    return Report("scheduler", WORKLOADS["scheduler"].description, [row], summary, columns)


# `spec`: requests to repeat or lightly edit a passage, the n-gram proposer's home ground.
SPEC_TASKS = [
    "Repeat the following passage word for word, with nothing before or after it.",
    "Copy the following passage exactly, but write every number in digits.",
    "Rewrite the following passage unchanged except that every 'the' becomes 'this'.",
    "Return the following passage in full with its spelling checked; change nothing else.",
]


def spec_prompts(llm, args: argparse.Namespace) -> list[list[int]]:
    """Chat prompts asking to repeat or edit one of PASSAGES (a model with a tokenizer and
    a chat template); else (dummy weights) a random passage of --max-input-len tokens
    written twice, which a model that copies its input continues."""
    rng = random.Random(args.seed)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        prompts = []
        vocab = min(10000, llm.engine.model_config.vocab_size)
        for _ in range(args.num_requests):
            passage = [rng.randrange(vocab) for _ in range(args.input_len[1] // 2)]
            prompts.append(passage + passage)
        return prompts
    out = []
    for i in range(args.num_requests):
        passage = PASSAGES[(args.seed + i) % len(PASSAGES)]
        task = SPEC_TASKS[i % len(SPEC_TASKS)]
        out.append(apply_chat_template(
            tokenizer, [{"role": "user", "content": f"{task}\n\n{passage}"}]))
    return out


def _spec_run(args: argparse.Namespace, name: str, speculative_config: dict | None,
              ) -> tuple[RunResult, list[list[int]], Any]:
    llm = make_llm(args, speculative_config=speculative_config)
    prompts = spec_prompts(llm, args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len[1])
    warm_up(llm, llm.engine.model_config.vocab_size)
    _sync()
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), args.streams):
        outs += llm.generate(prompts[i:i + args.streams], params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    result = RunResult(name, len(prompts), sum(map(len, prompts)), sum(map(len, tokens)),
                       elapsed)
    stats = llm.engine.get_stats()
    if speculative_config is not None:
        result.extra.update(acceptance_rate=stats.spec_acceptance_rate,
                            mean_accepted_length=stats.spec_mean_accepted_length)
    llm.engine.shutdown()
    del llm
    free_memory()
    return result, tokens, prompts


def bench_spec(args: argparse.Namespace) -> Report:
    """Plain decoding, then each proposer, on the same prompts, greedy; the outputs must be
    the same tokens. One engine at a time."""
    methods = ["ngram", "draft_model"] if args.method == "both" else [args.method]
    plain, plain_tokens, _ = _spec_run(args, "plain", None)
    runs: list[RunResult | dict] = [plain]
    summary: dict[str, Any] = {"streams": args.streams,
                               "num_speculative_tokens": args.num_speculative_tokens}
    for method in methods:
        config: dict[str, Any] = {"method": method,
                                  "num_speculative_tokens": args.num_speculative_tokens}
        if method == "ngram":
            config.update(prompt_lookup_min=args.prompt_lookup_min,
                          prompt_lookup_max=args.prompt_lookup_max)
        else:
            config.update(model=args.draft_model or args.model or _default_model(),
                          load_format=args.draft_load_format or args.load_format,
                          seed=args.seed)
        if args.disable_by_batch_size is not None:
            config["disable_by_batch_size"] = args.disable_by_batch_size
        result, tokens, _ = _spec_run(args, method, config)
        same = sum(a == b for a, b in zip(plain_tokens, tokens))
        result.extra["identical_outputs"] = f"{same}/{len(tokens)}"
        runs.append(result)
        summary[f"{method}_speedup"] = _ratio(result, plain)
        summary[f"{method}_acceptance_rate"] = result.extra["acceptance_rate"]
        summary[f"{method}_mean_accepted_length"] = result.extra["mean_accepted_length"]
        summary[f"{method}_identical_outputs"] = result.extra["identical_outputs"]
    columns = THROUGHPUT_COLUMNS + [("acceptance_rate", "accepted", "{:.1%}"),
                                    ("mean_accepted_length", "tok/verify", "{:.2f}"),
                                    ("identical_outputs", "same text", "{}")]
    return Report("spec", WORKLOADS["spec"].description, runs, summary, columns)


def _default_model() -> str:
    from pagedllm.loader import default_model_path

    return default_model_path()


STRUCTURED_TEXT = r"[A-Za-z0-9 ,.;:!?'()-]*"
STRUCTURED_JSON = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genre": {"enum": ["fiction", "science", "history", "poetry"]},
        "authors": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 30},
                           "born": {"type": "integer", "minimum": 1000, "maximum": 2025}},
            "required": ["name", "born"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "rating", "genre", "authors", "summary"],
}


def _follows(constraint: str, output: Any) -> bool:
    """The output obeys its constraint: the free-text regex, or (json) an object that
    parses and has the schema's required keys."""
    if constraint == "text":
        return re.fullmatch(STRUCTURED_TEXT, output.text) is not None
    try:
        value = json.loads(output.text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(STRUCTURED_JSON["required"]) <= set(value)


def bench_structured(args: argparse.Namespace) -> Report:
    """Per batch size: the same prompts unconstrained (ignore_eos, --max-tokens each) and
    with --constrained-fraction of them under a grammar. With --constraint text the
    constrained requests also run to --max-tokens (min_tokens keeps EOS out; the regex
    never ends), so both runs decode the same number of tokens and the difference is the
    masks' cost: filling them on the host (llguidance), applying them on the device, and
    the one-step-at-a-time scheduling constrained batches need."""
    from pagedllm.sampling_params import StructuredOutputsParams

    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise UsageError(f"--batch-sizes is a comma list of integers, got {args.batch_sizes!r}")
    if any(b < 1 for b in batch_sizes):
        raise UsageError(f"--batch-sizes must be at least 1 each, got {args.batch_sizes!r}")
    if not 0 < args.constrained_fraction <= 1:
        raise UsageError("--constrained-fraction must be in (0, 1], got "
                         f"{args.constrained_fraction}")
    length = args.output_len[1]
    # No prefix caching: both runs of a batch read the same prompts, and the second would
    # find them cached.
    overrides: dict[str, Any] = {"enable_prefix_caching": False}
    if args.tokenizer:
        overrides["tokenizer"] = args.tokenizer
    llm = make_llm(args, **overrides)
    tokenizer = llm.get_tokenizer()
    if args.constraint == "text":
        constraint = StructuredOutputsParams(regex=STRUCTURED_TEXT)
    else:
        constraint = StructuredOutputsParams(json=STRUCTURED_JSON)
    plain = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=length)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=length,
                                 min_tokens=length if args.constraint == "text" else 0,
                                 structured_outputs=constraint)
    warm_up(llm)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=constraint),
                 use_tqdm=False)  # llguidance's tokenizer is built once, untimed
    rng = random.Random(args.seed)
    runs: list[RunResult | dict] = []
    summary: dict[str, Any] = {"constraint": args.constraint,
                               "constrained_fraction": args.constrained_fraction}
    for batch in batch_sizes:
        if args.model is None and args.load_format != "dummy":
            prompts = text_prompts(tokenizer, rng, batch, args.input_len)
        else:
            prompts = random_prompts(rng, batch, args.input_len)
        k = max(1, round(batch * args.constrained_fraction))
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # this shape once
        kinds = [(f"batch {batch}: unconstrained", [plain] * batch),
                 (f"batch {batch}: {k}/{batch} constrained",
                  [constrained] * k + [plain] * (batch - k))]
        times: list[list[float]] = [[], []]
        rates: list[list[float]] = [[], []]  # tok/s per run, by repeat
        structured = llm.engine.structured
        host_before = structured.host_seconds
        for repeat in range(args.repeats):  # alternate the order: the host's load drifts
            for i in ((0, 1) if repeat % 2 == 0 else (1, 0)):
                result, outs_i = timed_generate(llm, kinds[i][0], prompts, kinds[i][1])
                times[i].append(result.elapsed_s)
                rates[i].append(result.output_tokens_per_s)
                if i == 0:
                    base = result
                else:
                    mixed, outs = result, outs_i
        base.elapsed_s, mixed.elapsed_s = (statistics.median(t) for t in times)
        for r in (base, mixed):
            r.extra["batch"] = batch
            r.extra["us_per_token"] = 1e6 * r.elapsed_s / max(r.output_tokens, 1)
        mixed.extra["constrained"] = k
        runs += [base, mixed]
        summary[f"batch {batch}: throughput ratio (constrained / unconstrained)"] = \
            _ratio(mixed, base)
        # Each repeat's two runs follow each other: their ratios show the spread that the
        # medians above hide (the host's load drifts between repeats).
        summary[f"batch {batch}: ratio per repeat (its two runs)"] = \
            [round(c / u, 3) if u else None for u, c in zip(*rates)]
        constrained_tokens = max(sum(len(o.outputs[0].token_ids) for o in outs[:k]), 1)
        summary[f"batch {batch}: time difference per constrained token (us)"] = (
            (mixed.elapsed_s - base.elapsed_s * mixed.output_tokens / max(base.output_tokens, 1))
            * 1e6 / constrained_tokens)
        summary[f"batch {batch}: engine thread's mask fill + matcher advance per constrained token (us)"] = (
            (structured.host_seconds - host_before) * 1e6 / (constrained_tokens * args.repeats))
        # json outputs cut at --max-tokens cannot parse: the finished ones are checked
        checked = [o.outputs[0] for o in outs[:k]
                   if args.constraint == "text" or o.outputs[0].finish_reason == "stop"]
        summary[f"batch {batch}: constrained outputs valid"] = \
            f"{sum(_follows(args.constraint, c) for c in checked)}/{len(checked)}"
    llm.engine.shutdown()
    del llm
    free_memory()
    columns = [("name", "run", "{}"), ("output_tokens", "out tokens", "{}"),
               ("elapsed_s", "seconds", "{:.2f}"), ("output_tokens_per_s", "tok/s", "{:.1f}"),
               ("us_per_token", "us/token", "{:.0f}")]
    return Report("structured", WORKLOADS["structured"].description, runs, summary, columns)


RUNNERS: dict[str, Callable[[argparse.Namespace], Report]] = {
    "cpu": bench_cpu, "nano": bench_nano, "decode-8b": bench_decode,
    "throughput-8b": bench_throughput, "prefix-8b": bench_prefix, "scheduler": bench_scheduler,
    "spec": bench_spec,
    "structured": bench_structured,
    "sharegpt": bench_sharegpt,
}


# ----------------------------------------------------------------------------- output


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import platform

    import transformers

    device = getattr(args, "device", "cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": device,
           "cpu_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def report_dict(report: Report, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("out", "plot", "workload", "min_input_len", "max_input_len",
                             "min_tokens", "max_tokens")}
    return {
        "workload": report.workload,
        "description": report.description,
        **machine.stamp(argv[1:], report.workload),
        "settings": settings,
        "engine_limits": dict(ENGINE_LIMITS),
        "environment": environment(args),
        "columns": [{"key": k, "header": h, "format": f} for k, h, f in report.columns],
        "runs": [r.to_dict() if isinstance(r, RunResult) else r for r in report.runs],
        "summary": report.summary,
    }


def format_table(report: Report, rows: list[dict[str, Any]]) -> str:
    headers = [h for _, h, _ in report.columns]
    cells = []
    for row in rows:
        if "error" in row:
            cells.append([row["name"], f"failed: {row['error']}"[:80]] + [""] * (len(headers) - 2))
            continue
        cells.append([fmt.format(row[key]) if row.get(key) is not None else "-"
                      for key, _, fmt in report.columns])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w)
                       in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                               for i, (v, w) in enumerate(zip(c, widths))))
    for key, value in report.summary.items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in value.items())
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def write_plot(report: Report, rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    key, label = ("mean_us", "us per step") if report.workload == "scheduler" else (
        "output_tokens_per_s", "output tokens/s")
    rows = [r for r in rows if r.get(key) is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["name"] for r in rows], [r[key] for r in rows])
    ax.set_xlabel(label)
    ax.set_title(f"pagedllm bench {report.workload}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    try:
        args = parse_args(list(argv))
        report = RUNNERS[args.workload](args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    data = report_dict(report, args, list(argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    if args.plot and write_plot(report, data["runs"], args.out.with_suffix(".png")):
        print(f"plot: {args.out.with_suffix('.png')}", file=sys.stderr)
    print(f"results: {args.out}", file=sys.stderr)
    print(format_table(report, data["runs"]))
    return 0
