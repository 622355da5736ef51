"""Inter-token latency of a running stream while another client sends a huge prompt.

One client streams a long completion (ignore_eos); once it is under way a second client sends
a prompt of --prompt-mb megabytes to one route; the stream is closed 20 tokens after that
request is answered. Printed per route: the stream's gaps before the big request (p50, max),
its gaps while the big request was in flight (p50, max), and how the big request was answered.

    pagedllm bench big-prompt                   # starts `pagedllm serve` from this checkout
    pagedllm bench big-prompt --repo /tmp/old   # ... from another checkout
    pagedllm bench big-prompt --url http://127.0.0.1:8000 --api-key KEY
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pagedllm.entrypoints.usage import Parser

REPO = Path(__file__).resolve().parents[2]  # the checkout holding pagedllm/
ROUTES = {
    "completions": ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 2}),
    "chat": ("/v1/chat/completions",
             lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
    "tokenize": ("/tokenize", lambda text: {"prompt": text}),
}


def start_server(repo: Path, args: list[str]) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(repo))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0", *args],
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.search(r" at (http://127\.0\.0\.1:\d+)", line)
        if found:
            return proc, found.group(1)
    raise RuntimeError(f"the server in {repo} did not start (exit {proc.wait()})")


async def measure(url: str, headers: dict[str, str], route: str, text: str) -> dict:
    path, body = ROUTES[route]
    stream_body = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0,
                   "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    big: dict = {}
    big_done = asyncio.Event()

    async def send_big(client: httpx.AsyncClient) -> None:
        big["start"] = time.perf_counter()
        resp = await client.post(url + path, json=body(text), headers=headers, timeout=600)
        big["end"] = time.perf_counter()
        big["status"] = resp.status_code
        big["answer"] = resp.text[:120]
        big_done.set()

    async with httpx.AsyncClient(timeout=600) as client:
        sender = None
        async with client.stream("POST", url + "/v1/completions", json=stream_body,
                                 headers=headers) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                arrivals.append(time.perf_counter())
                if len(arrivals) == 30:
                    sender = asyncio.ensure_future(send_big(client))
                if big_done.is_set() and arrivals[-1] > big["end"] and (
                        sum(t > big["end"] for t in arrivals) >= 20):
                    break
        assert sender is not None, "the stream ended before the big request was sent"
        await sender
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    before = [g for t, g in gaps if t < big["start"]][5:]  # skip the first tokens' warm-up
    # Every gap that overlaps the big request's time in flight.
    during = [g for t, g in gaps if t - g < big["end"] and t > big["start"]]
    return {
        "route": route,
        "itl_before_p50_ms": 1000 * statistics.median(before),
        "itl_before_max_ms": 1000 * max(before),
        "itl_during_p50_ms": 1000 * statistics.median(during) if during else None,
        "itl_during_max_ms": 1000 * max(during) if during else None,
        "tokens_during": len(during),
        "big_status": big["status"],
        "big_seconds": big["end"] - big["start"],
        "big_answer": big["answer"],
    }


def main(argv: list[str]) -> int:
    parser = Parser(prog="pagedllm bench big-prompt", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="the checkout whose server to start (default: this one)")
    parser.add_argument("--server-args", default="", help="extra `pagedllm serve` options")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--prompt-mb", type=float, default=4.0)
    parser.add_argument("--routes", default="completions,chat,tokenize")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.repo.resolve(), args.server_args.split())
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    text = "a " * int(args.prompt_mb * 1e6 / 2)
    try:
        rows = [asyncio.run(measure(url, headers, r, text)) for r in args.routes.split(",")]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.prompt_mb:g} MB prompt; server: {args.url or args.repo}")
    print(f"{'route':<12} {'ITL before p50/max ms':>22} {'ITL during p50/max ms':>22} "
          f"{'tokens during':>13} {'big request':>20}")
    for r in rows:
        during = (f"{r['itl_during_p50_ms']:.0f} / {r['itl_during_max_ms']:.0f}"
                  if r["itl_during_max_ms"] is not None else "-")
        print(f"{r['route']:<12} {r['itl_before_p50_ms']:>10.0f} / {r['itl_before_max_ms']:<9.0f}"
              f" {during:>22} {r['tokens_during']:>13} "
              f"{r['big_status']:>6} in {r['big_seconds']:.2f} s")
    return 0

