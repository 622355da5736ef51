"""AsyncLLMEngine: the LLMEngine stepped by a background task, one async stream per request.

Every call into the engine (add, abort, step, stats) runs on one dedicated worker thread, so
the engine is never touched by two threads at once and the event loop never blocks on the
model. The step loop sleeps on an Event while there is no work.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pagedllm.engine.state import engine_state
from pagedllm.engine.structured_output import new_matcher
from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine_args import EngineArgs
    from pagedllm.engine.llm_engine import EngineStats, LLMEngine
    from pagedllm.lora import LoRARequest
    from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

# With log_stats, the engine's load is logged at most this often (seconds), while it works.
STATS_LOG_INTERVAL = 10.0


class EngineDeadError(RuntimeError):
    """The engine raised inside step(); the requests that were in flight are dropped.
    `fatal`: the engine cannot go on (a tensor-parallel rank died); the server stops."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class OutputObserver(Protocol):
    """Sees every RequestOutput the engine produces (used by the server's metrics)."""

    def on_output(self, output: RequestOutput) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, in order; iterating ends after the finished output.

    abort() is synchronous so it can run in a `finally` of a cancelled task.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._on_abort = on_abort
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request if it is still running (no-op once finished)."""
        if not self.finished:
            self.finished = True
            self._on_abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observers: list[OutputObserver] | None = None,
                 log_stats: bool = False) -> None:
        self.engine = engine
        self.log_stats = log_stats  # EngineArgs.disable_log_stats turned around
        self._next_stats_log = 0.0
        self.observers: list[OutputObserver] = list(observers or [])
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")
        self._streams: dict[str, RequestStream] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        # Set when a step failed in a way the engine cannot recover from (a tensor-parallel
        # rank died): later requests are refused, and `on_fatal` (the server) is told.
        self.fatal_error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args), log_stats=not args.disable_log_stats)

    # What the server reads from the engine.
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.engine.model_config.hidden_size

    @property
    def served_model_names(self) -> list[str]:
        """Every --served-model-name; responses carry the first (model_name)."""
        return list(self.engine.served_model_names)

    def validate_grammar(self, grammar: str) -> None:
        """ValueError naming the problem when a compiled grammar fails against the engine's
        tokenizer under its limits, or allows no output at all (its first mask is computed:
        call it off the event loop)."""
        new_matcher(self.engine.structured.ll, grammar)

    async def engine_state(self) -> dict[str, Any]:
        """The scheduler's queues, the KV block pool and counters, read between two steps
        (engine/state.py; docs/engine_state.md)."""
        return await self.run_in_engine_thread(lambda: engine_state(self.engine.scheduler))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def run_in_engine_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the engine's thread (between steps): tokenizer and engine calls."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def get_stats(self) -> EngineStats:
        return await self.run_in_engine_thread(self.engine.get_stats)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request (under a LoRA adapter: `lora_request`); raises the engine's
        ValueError here, before any output."""
        if self.fatal_error is not None:
            raise EngineDeadError(f"the engine failed: {self.fatal_error}", fatal=True)
        self._ensure_loop()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self._abort_nowait)
        self._streams[request_id] = stream
        arrival = time.monotonic()
        try:
            await self.run_in_engine_thread(
                self.engine.add_request, request_id, prompt, params, arrival, lora_request
            )
        except asyncio.CancelledError:
            # The add may still complete on the engine thread: abort it behind the add.
            self._streams.pop(request_id, None)
            self._executor.submit(self._abort_in_engine, request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        assert self._wake is not None
        self._wake.set()
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; closing the iterator aborts the request."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _abort_nowait(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return
        for observer in self.observers:
            observer.on_abort(request_id)
        self._executor.submit(self._abort_in_engine, request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # an unknown id is not worth failing over
            logger.exception("abort of request %s failed", request_id)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    def _step(self) -> tuple[list[RequestOutput], bool]:
        outputs = self.engine.step()
        if self.log_stats and time.monotonic() >= self._next_stats_log:
            self._next_stats_log = time.monotonic() + STATS_LOG_INTERVAL
            s = self.engine.get_stats()
            logger.info(
                "engine: %d running, %d waiting, %d swapped requests; KV cache %.1f%% used; "
                "prefix cache hit rate %.1f%%; %d preemptions", s.num_running, s.num_waiting,
                s.num_swapped, 100 * s.kv_cache_usage, 100 * s.prefix_cache_hit_rate,
                s.num_preemptions,
            )
        return outputs, self.engine.has_unfinished_requests()

    async def _run_loop(self) -> None:
        assert self._wake is not None
        while True:
            # Clear before stepping: a request added during the step sets it again,
            # so the wait below cannot miss it.
            self._wake.clear()
            try:
                outputs, has_work = await self.run_in_engine_thread(self._step)
            except Exception as exc:
                if getattr(exc, "fatal", False):
                    logger.error("engine step failed: %s", exc)
                    self.fatal_error = exc
                else:
                    logger.exception("engine step failed")
                self._fail_all(exc)
                has_work, outputs = False, []
                if self.fatal_error is not None and self.on_fatal is not None:
                    self.on_fatal(exc)
            for output in outputs:
                self._deliver(output)
            if not has_work:
                await self._wake.wait()

    def _deliver(self, output: RequestOutput) -> None:
        for observer in self.observers:
            try:
                observer.on_output(output)
            except Exception:
                logger.exception("output observer failed")
        stream = self._streams.get(output.request_id)
        if stream is None:  # aborted by its client in the meantime
            return
        if output.finished:
            del self._streams[output.request_id]
        stream.put(output)

    def _fail_all(self, exc: Exception) -> None:
        """A step raised: end every in-flight request with the error, keep the loop alive."""
        error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}",
                                fatal=getattr(exc, "fatal", False))
        for request_id, stream in list(self._streams.items()):
            del self._streams[request_id]
            stream.put(error)
            for observer in self.observers:
                observer.on_abort(request_id)
            self._executor.submit(self._abort_in_engine, request_id)
