"""AsyncLLMEngine's own mechanics (stepping, sleeping, aborts, failures) and the app's 500 path.

These use a small scripted engine that follows LLMEngine's contract, so failures and timing
can be provoked on purpose; the real engine behind the real server is in test_server.py.
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.llm_engine import EngineStats
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams


class ScriptedEngine:
    """Every step gives each request one token (id = its count); it can be told to fail."""

    model_name = "scripted"
    served_model_names = ["scripted"]
    max_model_len = 64
    tokenizer = None
    model_config = SimpleNamespace(vocab_size=100)

    def __init__(self, step_seconds: float = 0.005) -> None:
        self.requests: dict[str, dict] = {}
        self.steps = 0
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.step_seconds = step_seconds

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = {"params": params, "tokens": [], "prompt": prompt,
                                     "metrics": RequestMetrics(arrival_time or time.monotonic())}

    def abort_request(self, request_id) -> None:
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        time.sleep(self.step_seconds)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("device fell over")
        outputs = []
        for request_id, r in list(self.requests.items()):
            token = len(r["tokens"])
            r["tokens"].append(token)
            now = time.monotonic()
            r["metrics"].first_token_time = r["metrics"].first_token_time or now
            r["metrics"].last_token_time = now
            done = len(r["tokens"]) >= r["params"].max_tokens
            text = "".join(f"t{t} " for t in r["tokens"])
            outputs.append(RequestOutput(
                request_id=request_id, prompt=None, prompt_token_ids=[1, 2],
                prompt_logprobs=None, finished=done, metrics=r["metrics"],
                outputs=[CompletionOutput(0, text, list(r["tokens"]), None, None,
                                          "length" if done else None)],
                deltas=[(f"t{token} ", [token])],
            ))
            if done:
                del self.requests[request_id]
        return outputs

    def get_stats(self):
        return EngineStats(num_running=len(self.requests), num_waiting=0, num_swapped=0,
                           kv_cache_usage=0.0, prefix_cache_hit_rate=0.0, num_preemptions=0,
                           num_gpu_blocks=64, block_size=16)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        raise ValueError("this model has no chat template")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_generate_streams_every_output_then_sleeps():
    async def main():
        engine = ScriptedEngine()
        aengine = AsyncLLMEngine(engine)
        outs = [o async for o in aengine.generate([1, 2], SamplingParams(max_tokens=5), "a")]
        assert [o.deltas[0][1] for o in outs] == [[0], [1], [2], [3], [4]]
        assert [o.finished for o in outs] == [False] * 4 + [True]
        steps = engine.steps
        await asyncio.sleep(0.3)  # no work: the loop waits on its event, it does not spin
        assert engine.steps == steps
        # ...and wakes for the next request.
        outs = [o async for o in aengine.generate([3], SamplingParams(max_tokens=2), "b")]
        assert outs[-1].outputs[0].token_ids == [0, 1]
        assert aengine.num_in_flight == 0
        await aengine.shutdown()

    run(main())


@pytest.mark.parametrize("log_stats", [False, True])
def test_stats_are_logged_only_when_asked(log_stats, caplog):
    async def main():
        aengine = AsyncLLMEngine(ScriptedEngine(), log_stats=log_stats)
        with caplog.at_level("INFO", logger="pagedllm.engine.async_engine"):
            outs = [o async for o in aengine.generate([1], SamplingParams(max_tokens=3), "a")]
        await aengine.shutdown()
        return outs

    assert len(run(main())) == 3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine:")]
    # Three steps well within one interval: one line (the first step), or none.
    assert lines == (["engine: 1 running, 0 waiting, 0 swapped requests; KV cache 0.0% used; "
                      "prefix cache hit rate 0.0%; 0 preemptions"] if log_stats else [])


def test_concurrent_requests_get_their_own_outputs():
    async def main():
        aengine = AsyncLLMEngine(ScriptedEngine())

        async def one(i: int) -> RequestOutput:
            async for out in aengine.generate([1], SamplingParams(max_tokens=i + 1), f"r{i}"):
                assert out.request_id == f"r{i}"
            return out

        finals = await asyncio.gather(*(one(i) for i in range(10)))
        assert [len(f.outputs[0].token_ids) for f in finals] == list(range(1, 11))
        await aengine.shutdown()

    run(main())


def test_add_request_errors_are_raised_before_streaming():
    async def main():
        aengine = AsyncLLMEngine(ScriptedEngine())
        with pytest.raises(ValueError, match="the prompt is empty"):
            await aengine.add_request([], SamplingParams(), "x")
        assert aengine.num_in_flight == 0
        stream = await aengine.add_request([1], SamplingParams(max_tokens=50), "dup")
        with pytest.raises(ValueError, match="already in use"):
            await aengine.add_request([1], SamplingParams(), "dup")
        stream.abort()
        await aengine.shutdown()

    run(main())


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_client_going_away_aborts_the_request(how):
    async def main():
        engine = ScriptedEngine()
        aengine = AsyncLLMEngine(engine)
        seen = asyncio.Event()

        async def consume():
            async for _ in aengine.generate([1], SamplingParams(max_tokens=10_000), "gone"):
                seen.set()
                if how == "close":
                    break  # the async-for closes the generator

        task = asyncio.ensure_future(consume())
        await seen.wait()
        if how == "cancel":
            task.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancel" else _nothing():
            await task
        for _ in range(100):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["gone"] and not engine.requests
        assert aengine.num_in_flight == 0
        await aengine.shutdown()

    run(main())


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_step_failure_fails_in_flight_requests_and_keeps_serving():
    async def main():
        engine = ScriptedEngine()
        aengine = AsyncLLMEngine(engine)
        stream = await aengine.add_request([1], SamplingParams(max_tokens=10_000), "doomed")
        await stream.__anext__()
        engine.fail_next_step = True
        with pytest.raises(EngineDeadError, match="device fell over"):
            async for _ in stream:
                pass
        outs = [o async for o in aengine.generate([1], SamplingParams(max_tokens=3), "next")]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2]
        await aengine.shutdown()

    run(main())


def test_app_returns_500_in_openai_shape_and_recovers():
    async def main():
        engine = ScriptedEngine(step_seconds=0.05)
        aengine = AsyncLLMEngine(engine)
        app = build_app(aengine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": [5, 6], "max_tokens": 100}
            pending = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while not engine.requests:
                await asyncio.sleep(0.01)
            engine.fail_next_step = True
            resp = await pending
            assert resp.status_code == 500
            error = resp.json()["error"]
            assert error["type"] == "internal_server_error"
            assert "device fell over" in error["message"]

            ok = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            assert ok.status_code == 200
            assert ok.json()["choices"][0]["text"] == "t0 t1 "

            chat = await client.post("/v1/chat/completions",
                                     json={"messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 400
            assert "no chat template" in chat.json()["error"]["message"]
        await aengine.shutdown()

    run(main())


def test_unknown_field_names_are_remembered_up_to_a_bound(caplog):
    """Clients choose the names: one log line per request, and a bounded memory of them."""
    from pagedllm.entrypoints.openai import protocol

    body = {"prompt": [1], **{f"x{i}": i for i in range(3 * protocol.MAX_WARNED_FIELDS)}}
    with caplog.at_level("WARNING", logger=protocol.__name__):
        for _ in range(3):
            protocol.CompletionRequest.model_validate(body)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("CompletionRequest: ignoring the unknown field(s) 'x0', 'x1', ")
    assert line.endswith(" ... (logged once per field)")
    assert len(protocol._warned_fields) <= protocol.MAX_WARNED_FIELDS
