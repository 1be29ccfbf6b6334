"""The engine's step loop on its own thread, fed and read from an asyncio event loop.

The event loop never waits on model work: requests and aborts go to the engine thread as
commands, applied between steps, and each step's outputs come back to their requests'
asyncio queues through ``call_soon_threadsafe``. The model's C++ kernels release the GIL, so
the event loop keeps serving HTTP while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdraft.engine.llm_engine import LLMEngine, RequestOutput
from fastdraft.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests wait than the server's ``max_queue``."""


class EngineError(RuntimeError):
    """A step failed while this request was in it."""


@dataclass
class StepStats:
    """What the engine did in one step, for the metrics (engine thread -> event loop)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_prefix_queries: int
    num_prefix_hits: int
    num_preemptions: int


def add_all_or_none(engine: LLMEngine, requests: list[tuple[str | list[int], SamplingParams, str]]) -> None:
    """Add requests (prompt, params, request id) together: a refused one aborts those added
    before it and raises the engine's error."""
    added = []
    try:
        for prompt, params, request_id in requests:
            engine.add_request(prompt, params, request_id)
            added.append(request_id)
    except Exception:
        for request_id in added:
            engine.abort_request(request_id)
        raise


@dataclass
class StepResult:
    """One step of a server's engine loop: its outputs and counters, or, when the step raised,
    the requests it was running (aborted, so the engine keeps serving) and why."""

    outputs: list[RequestOutput]
    stats: StepStats | None
    failed_request_ids: list[str]
    error: str = ""


def run_step(engine: LLMEngine) -> StepResult:
    """Run one engine step for a server loop (see :class:`StepResult`)."""
    try:
        outputs = engine.step()
    except Exception as e:  # the requests of this step fail; the server keeps serving
        logger.exception("engine step failed")
        failed = [seq.request_id for seq in engine.scheduler.running]  # their cache may be half written
        for request_id in failed:
            engine.abort_request(request_id)
        return StepResult([], None, failed, f"the engine failed: {e}")
    scheduler, blocks = engine.scheduler, engine.block_manager
    stats = StepStats(len(scheduler.running), len(scheduler.waiting), blocks.usage, blocks.num_prefix_queries,
                      blocks.num_prefix_hits, scheduler.num_preemptions)
    return StepResult(outputs, stats, [])


class AsyncEngine:
    """Owns an :class:`LLMEngine` and the thread that steps it.

    ``on_step`` is called on the event loop after each step with a :class:`StepStats`."""

    def __init__(self, engine: LLMEngine, max_queue: int, on_step: Callable[[StepStats], None] | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step
        self._commands: deque[Callable[[], None]] = deque()
        self._streams: dict[str, asyncio.Queue] = {}
        self._num_waiting = 0  # requests added and not yet past their first token, as last counted
        self._wake = threading.Event()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="fastdraft-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; requests still running are aborted."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.loaded.config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + len(self._commands)

    async def add_requests(self, requests: list[tuple[str | list[int], SamplingParams, str]]) -> list[RequestStream]:
        """Queue requests (prompt, params, request id) together and return their streams.
        Raises ``QueueFullError`` when the queue is full, and the engine's ``ValueError`` for a
        request it refuses; then none of them stays queued."""
        if self.num_waiting + len(requests) > self.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are waiting; the limit is {self.max_queue}")
        loop = asyncio.get_running_loop()
        added: asyncio.Future = loop.create_future()
        streams = [RequestStream(self, request_id) for _, _, request_id in requests]
        for stream in streams:
            self._streams[stream.request_id] = stream.queue

        def add() -> None:
            try:
                add_all_or_none(self.engine, requests)
            except Exception as e:  # refused: the caller gets the engine's own message
                loop.call_soon_threadsafe(_settle, added, e)
            else:
                loop.call_soon_threadsafe(_settle, added, None)

        self._submit(add)
        try:
            await added
        except BaseException:
            for stream in streams:
                stream.is_finished = True  # refused (or the caller cancelled): abort whatever was added
                self._streams.pop(stream.request_id, None)
                self._submit(lambda request_id=stream.request_id: self.engine.abort_request(request_id))
            raise
        return streams

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._submit(lambda: self.engine.abort_request(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    @torch.inference_mode()
    def _run(self) -> None:
        engine, loop = self.engine, self._loop
        while not self._stopping:
            while self._commands:
                self._commands.popleft()()
            if not engine.has_unfinished_requests:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            result = run_step(engine)
            for request_id in result.failed_request_ids:
                loop.call_soon_threadsafe(self._deliver, request_id, EngineError(result.error))
            if result.stats is None:
                continue
            self._num_waiting = result.stats.num_waiting
            for out in result.outputs:
                loop.call_soon_threadsafe(self._deliver, out.request_id, out)
            if self.on_step is not None:
                loop.call_soon_threadsafe(self.on_step, result.stats)
        for request_id in list(self._streams):  # stopped: nothing more will come
            engine.abort_request(request_id)
            loop.call_soon_threadsafe(self._deliver, request_id, EngineError("the server is shutting down"))


class RequestStream:
    """One request's outputs, in order, as an async iterator; ``close`` aborts it unless it
    finished (a client gone: its blocks are freed before the next step)."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.is_finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        self.is_finished = item.is_finished
        return item

    def close(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            self.engine.abort(self.request_id)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
