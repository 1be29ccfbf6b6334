"""The engine's step loop on its own thread, fed and read from an asyncio event loop.

The event loop never waits on model work: requests and aborts go to the engine thread as
commands, applied between steps, and each step's deltas come back to their requests'
asyncio queues through one ``call_soon_threadsafe`` a step. The model's C++ kernels release the GIL, so
the event loop keeps serving HTTP while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

from fastdraft.engine.llm_engine import LLMEngine
from fastdraft.engine.output import RequestDelta
from fastdraft.server.engine_client import (EngineError, EngineInfo, QueuedRequest, QueueFullError, RequestStream, StepStats,
                                            add_all_or_none, run_step, settle)

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Owns an :class:`LLMEngine` and the thread that steps it (an
    :class:`~fastdraft.server.engine_client.EngineClient`).

    ``on_step`` is called on the event loop after each step with a :class:`StepStats`."""

    def __init__(self, engine: LLMEngine, max_queue: int, on_step: Callable[[StepStats], None] | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.engine = engine
        self.info = EngineInfo.of(engine)
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

    @property
    def is_alive(self) -> bool:
        """Whether the step loop's thread runs."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; requests still running are aborted."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + len(self._commands)

    async def add_requests(self, requests: list[QueuedRequest]) -> list[RequestStream]:
        """Queue requests together and return their streams. Raises ``QueueFullError`` when
        the queue is full, and the engine's ``ValueError`` for a request it refuses; then none
        of them stays queued."""
        if self.num_waiting + len(requests) > self.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are waiting; the limit is {self.max_queue}")
        loop = asyncio.get_running_loop()
        added: asyncio.Future = loop.create_future()
        streams = [RequestStream(self, request_id, prompt) for prompt, _, request_id in requests]
        for stream in streams:
            self._streams[stream.request_id] = stream.queue

        def add() -> None:
            try:
                add_all_or_none(self.engine, requests)
            except Exception as e:  # refused: the caller gets the engine's own message
                loop.call_soon_threadsafe(settle, added, e)
            else:
                loop.call_soon_threadsafe(settle, added, None)

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

    def _deliver(self, request_id: str, item: RequestDelta | BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _deliver_step(self, deltas: list[RequestDelta], stats: StepStats) -> None:
        """A step's deltas and counters, handed over in one call: one wake-up of the event
        loop a step, not one per request."""
        for delta in deltas:
            self._deliver(delta.request_id, delta)
        if self.on_step is not None:
            self.on_step(stats)

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
            loop.call_soon_threadsafe(self._deliver_step, result.deltas, result.stats)
        for request_id in list(self._streams):  # stopped: nothing more will come
            engine.abort_request(request_id)
            loop.call_soon_threadsafe(self._deliver, request_id, EngineError("the server is shutting down"))
