"""What the HTTP side needs of an engine loop, whether a thread or a child process runs it:
the :class:`EngineClient` protocol, and what both implementations share (request streams,
errors, step statistics, the loop's step and add helpers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from fastdraft.engine.llm_engine import LLMEngine
from fastdraft.engine.output import RequestCollector, RequestDelta
from fastdraft.sampling_params import SamplingParams
from fastdraft.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A request as the server queues it: (prompt token ids, sampling parameters, request id).
QueuedRequest = tuple[list[int], SamplingParams, str]


class QueueFullError(RuntimeError):
    """More requests wait than the server's ``max_queue``."""


class EngineError(RuntimeError):
    """A step failed while this request was in it."""


@dataclass
class StepStats:
    """What the engine did in one step, for the metrics (engine loop -> event loop)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_prefix_queries: int
    num_prefix_hits: int
    num_preemptions: int


@dataclass
class EngineInfo:
    """What the server needs of an engine it does not hold (in a child process, on Ray replicas)
    to check and tokenize requests."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    weights: str = ""  # which weights run (engine/loader.py::describe_weights)

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.tokenizer, engine.vocab_size, engine.max_model_len, engine.weights)


class EngineClient(Protocol):
    """An engine loop the event loop feeds requests and reads deltas from."""

    info: EngineInfo | None  # the engine's tokenizer and limits, once started
    num_waiting: int  # requests queued and not yet past their first token

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop; deltas are delivered on ``loop``."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; requests still running are aborted."""

    async def add_requests(self, requests: list[QueuedRequest]) -> list[RequestStream]:
        """Queue requests together and return their streams. ``QueueFullError`` when the
        queue is full, the engine's ``ValueError`` for a request it refuses; then none of them
        stays queued."""

    def abort(self, request_id: str) -> None:
        """Abort a request (its client went away); nothing more is delivered for it."""


class RequestStream:
    """One request's deltas, in order, as an async iterator; ``collector`` folds them into the
    request's output as they pass. ``close`` aborts the request unless it finished (a client
    gone: its blocks are freed before the next step)."""

    def __init__(self, engine: EngineClient, request_id: str, prompt_token_ids: list[int]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.collector = RequestCollector(request_id, prompt_token_ids)
        self.is_finished = False

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.is_finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        self.collector.add(item)
        self.is_finished = item.is_finished
        return item

    def close(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            self.engine.abort(self.request_id)


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[list[tuple[int, RequestDelta | EngineError]]]:
    """Several requests' deltas as they come, each with its stream's index, in batches: a batch
    holds every delta that arrived since the consumer took the previous one (one, while it keeps
    up). A failed request's ``EngineError`` stands in place of its next delta. Ends when every
    stream has; leaving early stops reading them (closing them is the caller's)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except EngineError as e:
            await queue.put((index, e))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            remaining -= sum(item is None for _, item in batch)
            batch = [(index, item) for index, item in batch if item is not None]
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()


def settle(future: asyncio.Future, error: BaseException | None) -> None:
    """Resolve ``future`` (with ``error``, when there is one) unless it is already done."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def add_all_or_none(engine: LLMEngine, requests: list[QueuedRequest]) -> None:
    """Add requests together: a refused one aborts those added before it and raises the
    engine's error."""
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
    """One step of a server's engine loop: its deltas and counters, or, when the step raised,
    the requests it was running (aborted, so the engine keeps serving) and why."""

    deltas: list[RequestDelta]
    stats: StepStats | None
    failed_request_ids: list[str]
    error: str = ""


def run_step(engine: LLMEngine) -> StepResult:
    """Run one engine step for a server loop (see :class:`StepResult`)."""
    try:
        deltas = engine.step()
    except Exception as e:  # the requests of this step fail; the server keeps serving
        logger.exception("engine step failed")
        failed = [seq.request_id for seq in engine.scheduler.running]  # their cache may be half written
        for request_id in failed:
            engine.abort_request(request_id)
        return StepResult([], None, failed, f"the engine failed: {e}")
    scheduler, blocks = engine.scheduler, engine.block_manager
    stats = StepStats(len(scheduler.running), len(scheduler.waiting), blocks.usage, blocks.num_prefix_queries,
                      blocks.num_prefix_hits, scheduler.num_preemptions)
    return StepResult(deltas, stats, [])
