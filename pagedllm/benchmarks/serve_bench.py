"""`pagedllm bench serve`: streaming requests against the HTTP server, either from N
concurrent clients (each sends its next request when the last one ends) or, as vLLM's serving
benchmark, at fixed request rates (`--request-rate 1 2 4 inf`: Poisson arrivals drawn from
--seed; inf sends every request at once).

Drives a running server (--url) or starts one (`pagedllm serve --port 0` plus any options
this command does not know), and reports requests/s, output tokens/s, time to first token
and inter-token latency (p50 / p99), per rate; --out writes them as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from pagedllm.benchmarks import machine
from pagedllm.benchmarks.server_process import ServerProcess
from pagedllm.entrypoints.usage import Parser, UsageError

PROMPTS = [
    "Explain what a hash table is.",
    "Write a short poem about the sea.",
    "What are the main causes of inflation?",
    "Give me three tips for learning a new language.",
    "Describe how a bicycle works.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of a detective story in a few sentences.",
    "Why is the sky blue?",
]


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def stream_one(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # every request makes exactly max_tokens: comparable runs
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = True
    return result


def _client(url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                             limits=httpx.Limits(max_connections=connections + 1))


async def _served_model(client: httpx.AsyncClient) -> str:
    models = await client.get("/v1/models")
    models.raise_for_status()
    return models.json()["data"][0]["id"]


async def run_clients(
    url: str, num_clients: int, num_requests: int, max_tokens: int, api_key: str | None = None
) -> tuple[list[RequestResult], float]:
    async with _client(url, api_key, num_clients) as client:
        model = await _served_model(client)
        counter = itertools.count()
        results: list[RequestResult] = []

        async def worker() -> None:
            while (i := next(counter)) < num_requests:
                results.append(await stream_one(client, model, PROMPTS[i % len(PROMPTS)],
                                                max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(num_clients)))
        return results, time.perf_counter() - start


def arrival_gaps(rate: float, count: int, seed: int) -> list[float]:
    """The seconds before each request: a Poisson process of `rate` requests/s (exponential
    gaps), the first request at 0; an infinite rate sends them all at once."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]


async def run_rate(
    url: str, rate: float, num_prompts: int, max_tokens: int, seed: int,
    api_key: str | None = None
) -> tuple[list[RequestResult], float]:
    """num_prompts requests arriving at `rate` requests/s, however many are in flight."""
    async with _client(url, api_key, num_prompts) as client:
        model = await _served_model(client)
        await stream_one(client, model, PROMPTS[0], 2)  # warm-up, not counted
        tasks = []
        start = time.perf_counter()
        for i, gap in enumerate(arrival_gaps(rate, num_prompts, seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(
                stream_one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "output_tokens": output_tokens,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "output_tokens_per_s": output_tokens / duration if duration else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "itl_p50_ms": percentile(itls, 50) * 1000,
        "itl_p99_ms": percentile(itls, 99) * 1000,
    }


def format_summary(summary: dict[str, float | None], load: str) -> str:
    s = {k: float("nan") if v is None else v for k, v in summary.items()}
    return "\n".join([
        f"{load}, requests {s['requests']} ({s['failed']} failed) "
        f"in {s['duration_s']:.2f} s",
        f"  requests/s         {s['requests_per_s']:10.2f}",
        f"  output tokens/s    {s['output_tokens_per_s']:10.1f}",
        f"  TTFT p50 / p99     {s['ttft_p50_ms']:10.1f} / {s['ttft_p99_ms']:.1f} ms",
        f"  ITL  p50 / p99     {s['itl_p50_ms']:10.1f} / {s['itl_p99_ms']:.1f} ms",
    ])


def request_rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of requests/s: {value!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {value}")
    return rate


def build_parser() -> Parser:
    parser = Parser(prog="pagedllm bench serve",
                    description="Streaming requests against the OpenAI-compatible server, "
                    "from concurrent clients or at fixed request rates. Options not listed "
                    "here go to `pagedllm serve` when this command starts the server itself.")
    parser.add_argument("--url", default=None,
                        help="a running server, e.g. http://127.0.0.1:8000 (default: start one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-rate", type=request_rate, nargs="+", default=None,
                        metavar="R", help="requests/s, Poisson arrivals (inf: all at once); "
                        "several values run one after another (default: --num-clients mode)")
    parser.add_argument("--seed", type=int, default=0, help="of the arrival times (default: 0)")
    parser.add_argument("--num-clients", type=int, default=8,
                        help="concurrent clients, without --request-rate (default: 8)")
    parser.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int,
                        default=32, help="requests per run (per rate) (default: 32)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output tokens of every request (ignore_eos) (default: 64)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--out", default=None, metavar="FILE.json",
                        help="write the runs' results to this file as JSON")
    return parser


def _runs(args: argparse.Namespace, url: str) -> list[dict]:
    """One summary per rate (or the one concurrent-clients run), with its load named."""
    runs = []
    for rate in args.request_rate or [None]:
        if rate is None:
            results, duration = asyncio.run(run_clients(
                url, args.num_clients, args.num_requests, args.max_tokens, args.api_key))
            load = {"num_clients": args.num_clients}
        else:
            results, duration = asyncio.run(run_rate(
                url, rate, args.num_requests, args.max_tokens, args.seed, args.api_key))
            load = {"request_rate": "inf" if math.isinf(rate) else rate}
        for error in sorted({r.error for r in results if r.error})[:5]:
            print(f"failed request: {error}", file=sys.stderr)
        summary = {k: None if isinstance(v, float) and math.isnan(v) else v
                   for k, v in summarize(results, duration).items()}  # JSON has no NaN
        runs.append({**load, **summary})
        label = (f"clients {args.num_clients}" if rate is None
                 else f"request rate {load['request_rate']}/s")
        print(json.dumps(runs[-1]) if args.json else format_summary(runs[-1], label),
              flush=True)
    return runs


def out_report(args: argparse.Namespace, argv: list[str], serve_args: list[str],
               runs: list[dict]) -> dict:
    """What --out writes: the runs (one per rate) with their load, date, command and host."""
    return {"workload": "serve", **machine.stamp(argv, "serve"), "url": args.url,
            "serve_args": serve_args, "max_tokens": args.max_tokens,
            "num_prompts": args.num_requests, "seed": args.seed, "runs": runs}


def main(argv: list[str]) -> int:
    args, serve_args = build_parser().parse_known_args(argv)
    for name in ("num_clients", "num_requests", "max_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.url and serve_args:
        raise UsageError(f"unrecognized arguments: {' '.join(serve_args)}")

    server, url = None, args.url
    if url is None:
        serve_args = serve_args + (["--api-key", args.api_key] if args.api_key else [])
        try:
            server = ServerProcess(serve_args)
        except RuntimeError as exc:
            raise UsageError(str(exc)) from None
        url = server.url
    try:
        runs = _runs(args, url.rstrip("/"))
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach the server at {url}: {exc}") from None
    finally:
        if server is not None:
            server.stop()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out_report(args, argv, serve_args, runs), f, indent=2)
    return 0 if all(run["failed"] == 0 for run in runs) else 1
