"""The engine's step loop in a child process (an engine core, as vLLM runs it), fed and read over pipes.

The server's event loop and the engine then hold separate interpreters, so neither waits on
the other's GIL; in exchange, every request, abort and step's deltas cross a pipe, pickled.
:class:`EngineProcess` offers what :class:`~fastdraft.server.async_engine.AsyncEngine` offers
(the default, a thread), and ``fastdraft serve --engine-process`` picks it. docs/server.md
compares the two.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from fastdraft.engine.llm_engine import LLMEngine
from fastdraft.engine.output import RequestDelta
from fastdraft.process import configure_process
from fastdraft.server.engine_client import (EngineError, EngineInfo, QueuedRequest, QueueFullError, RequestStream,
                                            StepStats, add_all_or_none, run_step, settle)


def _engine_core(load_engine: Callable[[], LLMEngine], num_threads: int, commands: Connection,
                 events: Connection) -> None:
    """The child's main: load, then apply commands between steps and send each step's deltas."""
    # A spawned child starts from defaults; fastdraft made this process, so it gives it the
    # parent's thread count and the tuned malloc.
    configure_process(num_threads=num_threads)
    try:
        engine = load_engine()
    except BaseException as e:  # the parent reports it; /health says the model failed to load
        events.send(("load_failed", f"{type(e).__name__}: {e}"))
        return
    events.send(("ready", EngineInfo.of(engine)))
    with torch.inference_mode():
        while True:
            # Wait for work only when there is none to do.
            timeout = 0.0 if engine.has_unfinished_requests else 0.5
            while commands.poll(timeout):
                timeout = 0.0
                kind, *args = commands.recv()
                if kind == "stop":
                    engine.abort_all()
                    return
                if kind == "abort":
                    engine.abort_request(args[0])
                elif kind == "add":
                    token, requests = args
                    try:
                        add_all_or_none(engine, requests)
                    except Exception as e:  # refused: none of them stays queued
                        events.send(("added", token, e))
                    else:
                        events.send(("added", token, None))
            if not engine.has_unfinished_requests:
                continue
            result = run_step(engine)
            if result.stats is None:
                events.send(("failed", result.failed_request_ids, result.error))
            else:
                events.send(("step", result.deltas, result.stats))


class EngineProcess:
    """Runs an :class:`LLMEngine` in a child process and streams its deltas to asyncio queues
    (an :class:`~fastdraft.server.engine_client.EngineClient`).

    ``load_engine`` must be picklable (a module-level function or a ``functools.partial`` of
    one): the child is started with ``spawn`` and calls it there. ``on_step`` is called on the
    event loop after each step with a :class:`StepStats`."""

    def __init__(self, load_engine: Callable[[], LLMEngine], max_queue: int,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.max_queue = max_queue
        self.on_step = on_step
        context = multiprocessing.get_context("spawn")
        child_commands, self._commands = context.Pipe(duplex=False)
        self._events, child_events = context.Pipe(duplex=False)
        self._process = context.Process(target=_engine_core, name="fastdraft-engine-core", daemon=True,
                                        args=(load_engine, torch.get_num_threads(), child_commands, child_events))
        self._send_lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue] = {}
        # Add commands the child has not answered: token -> (their future, number of requests).
        self._pending: dict[int, tuple[asyncio.Future, int]] = {}
        self._next_token = 0
        self._num_waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader = threading.Thread(target=self._read, name="fastdraft-engine-events", daemon=True)
        self.info: EngineInfo | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the child and wait until its engine is loaded (call it off the event loop)."""
        self._loop = loop
        self._process.start()
        kind, payload = self._events.recv()
        if kind != "ready":
            self._process.join(10)
            raise RuntimeError(f"the engine process failed to load the model: {payload}")
        self.info = payload
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child after its current step; requests still running are aborted."""
        try:
            self._send(("stop",))
        except OSError:
            pass  # already gone
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
        self._fail_all("the server is shutting down")

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + sum(num for _, num in self._pending.values())

    async def add_requests(self, requests: list[QueuedRequest]) -> list[RequestStream]:
        """As :meth:`EngineClient.add_requests`."""
        if self.num_waiting + len(requests) > self.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are waiting; the limit is {self.max_queue}")
        streams = [RequestStream(self, request_id, prompt) for prompt, _, request_id in requests]
        for stream in streams:
            self._streams[stream.request_id] = stream.queue
        token, self._next_token = self._next_token, self._next_token + 1
        added = asyncio.get_running_loop().create_future()
        self._pending[token] = (added, len(requests))
        try:
            self._send(("add", token, requests))
            await added
        except BaseException:
            for stream in streams:
                stream.is_finished = True
                self.abort(stream.request_id)
            raise
        finally:
            self._pending.pop(token, None)
        return streams

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        try:
            self._send(("abort", request_id))
        except OSError:
            pass  # the child is gone: nothing runs

    def _send(self, command: tuple) -> None:
        # A pipe write: it blocks only while the pipe is full, and the child drains it between steps.
        with self._send_lock:
            self._commands.send(command)

    def _read(self) -> None:
        """The reader thread: hand each event from the child to the event loop."""
        while True:
            try:
                event = self._events.recv()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._fail_all, "the engine process exited")
                return
            self._loop.call_soon_threadsafe(self._dispatch, event)

    def _dispatch(self, event: tuple) -> None:
        kind = event[0]
        if kind == "step":
            _, deltas, stats = event
            self._num_waiting = stats.num_waiting
            for delta in deltas:
                self._deliver(delta.request_id, delta)
            if self.on_step is not None:
                self.on_step(stats)
        elif kind == "added":
            _, token, error = event
            if token in self._pending:
                settle(self._pending[token][0], error)
        elif kind == "failed":
            _, request_ids, message = event
            for request_id in request_ids:
                self._deliver(request_id, EngineError(message))

    def _deliver(self, request_id: str, item: RequestDelta | BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, EngineError(message))
        for future, _ in list(self._pending.values()):
            settle(future, EngineError(message))
