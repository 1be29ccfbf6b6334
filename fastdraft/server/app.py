"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and ``/metrics``.

Every refused request gets the OpenAI error shape ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status; a request that fails inside the engine gets a 500, and the server
keeps serving. A streaming client that goes away aborts its request, which frees its KV blocks
before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdraft.engine.llm_engine import LLMEngine
from fastdraft.engine.output import RequestCollector, RequestDelta
from fastdraft.engine.request import RejectedRequest, check_request
from fastdraft.server.async_engine import AsyncEngine
from fastdraft.server.engine_client import (EngineClient, EngineError, QueueFullError, RequestStream, StepStats,
                                            merge_streams)
from fastdraft.server.engine_process import EngineProcess
from fastdraft.server.prometheus import ServerMetrics
from fastdraft.server.protocol import (MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest, RequestError,
                                       error_body)
from fastdraft.engine.tool_calls import (ToolError, ToolUse, check_tools, message_calls, prompt_tools,
                                         template_messages)
from fastdraft.engine.tool_parsers import ToolCallStream, tool_parser_for

logger = logging.getLogger(__name__)

# Seconds a client refused for a full queue is asked to wait (Retry-After).
RETRY_AFTER_S = 1


@dataclass
class ServerConfig:
    """How the HTTP side behaves; checked with ``ValueError``."""

    served_model_name: str
    api_key: str | None = None
    max_queue: int = 256
    chat_template: str | None = None  # a Jinja template replacing the model's own
    tool_call_parser: str | None = None  # the model's tool-call format (default: from its chat template)
    # The engine's step loop in a child process (EngineProcess) instead of a thread
    # (AsyncEngine); load_engine must then be picklable.
    engine_process: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser is not None:
            tool_parser_for(None, self.tool_call_parser)  # ValueError naming the known ones


class _State:
    def __init__(self) -> None:
        self.engine: EngineClient | None = None
        self.load_error: BaseException | None = None


def build_fastapi_app(load_engine: Callable[[], LLMEngine] | None, config: ServerConfig,
                      connect: Callable[[Callable[[StepStats], None]], EngineClient] | None = None) -> FastAPI:
    """The app; ``load_engine`` runs on a thread at start-up, or in the engine's child process
    with ``config.engine_process`` (``/health`` says 503 until it is done), so the port answers
    while the model loads. ``connect``, instead, makes a client of engines served elsewhere (Ray
    Serve replicas), given the step-statistics callback."""
    if (load_engine is None) == (connect is None):
        raise ValueError("give load_engine or connect, not both")
    state = _State()
    metrics = ServerMetrics(config.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                if connect is not None:
                    async_engine = connect(metrics.record_step)
                elif config.engine_process:
                    async_engine = EngineProcess(load_engine, config.max_queue, metrics.record_step)
                else:
                    async_engine = AsyncEngine(load_engine(), config.max_queue, metrics.record_step)
                async_engine.start(loop)
                if config.chat_template is not None:
                    async_engine.info.tokenizer.set_chat_template(config.chat_template)
                state.engine = async_engine
                logger.info("ready: serving %s", config.served_model_name)
            except BaseException as e:  # /health reports it; requests get 503
                logger.exception("loading the model failed")
                state.load_error = e

        loader = threading.Thread(target=load, name="fastdraft-loader", daemon=True)
        loader.start()
        yield
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="fastdraft", version="0.1.0", lifespan=lifespan)

    def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {message}", "invalid_request_error")
        param = loc[0] if loc else None
        where = ".".join(loc)
        return error(400, f"{where}: {message}" if where else message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind)

    if config.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)

    def engine_or_error() -> EngineClient | JSONResponse:
        if state.engine is None:
            message = "the model failed to load" if state.load_error else "the model is loading"
            return error(503, message, "service_unavailable")
        return state.engine

    def check_model(name: str) -> None:
        if name != config.served_model_name:
            raise RequestError(f"the model '{name}' does not exist; this server serves "
                               f"'{config.served_model_name}'", param="model", status=404, code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None:
            return error(503, "the model failed to load" if state.load_error else "the model is loading",
                         "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "fastdraft"}
        if state.engine is not None:  # which weights run, once the model is loaded
            card["weights"] = state.engine.info.weights
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        return await _serve(body, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return await _serve(body, is_chat=True)

    async def _serve(body: CompletionRequest | ChatCompletionRequest, is_chat: bool) -> Response:
        engine = engine_or_error()
        if isinstance(engine, JSONResponse):
            return engine
        try:
            body.check_extra()
            check_model(body.model)
            tool_use = _tool_use(engine, body, config) if is_chat else None
            jobs = _jobs(engine, body, is_chat)
        except RequestError as e:
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return error(e.status, str(e), kind, e.param, e.code)
        request_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        try:  # every choice queued at once: refusals come before any answer
            streams = await engine.add_requests([(prompt, params, f"{request_id}-{i}")
                                                 for i, (prompt, params) in enumerate(jobs)])
        except QueueFullError as e:
            return error(429, str(e), "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        except ValueError as e:  # the engine refused it (no room in its cache)
            return error(400, str(e), "invalid_request_error", "messages" if is_chat else "prompt")
        render = _ChatRender(engine, body, tool_use) if is_chat else _CompletionRender(engine, body)
        if body.stream:
            return StreamingResponse(_sse(streams, render, metrics, request_id, created, body),
                                     media_type="text/event-stream")
        try:
            finals = await asyncio.gather(*(_collect(stream, metrics) for stream in streams))
        except EngineError as e:
            return error(500, str(e), "internal_error")
        finally:
            for stream in streams:
                stream.close()
        choices = [render.choice(i, request) for i, request in enumerate(finals)]
        kind = "chat.completion" if is_chat else "text_completion"
        return JSONResponse({"id": request_id, "object": kind, "created": created, "model": body.model,
                             "choices": choices, "usage": _usage(finals)})

    return app


def _tool_use(engine: EngineClient, body: ChatCompletionRequest, config: ServerConfig) -> ToolUse | None:
    """The request's tool use, its required call's grammar set as the output's constraint."""
    parser = tool_parser_for(engine.info.tokenizer.chat_template, config.tool_call_parser)
    try:
        use = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls, parser)
    except ToolError as e:
        raise RequestError(str(e), param=e.param) from None
    constraint = use.constraint(engine.info.tokenizer) if use is not None else None
    if constraint is not None:
        if body._constraint is not None:
            raise RequestError("a required tool call cannot also follow response_format or structured_outputs",
                               param="tool_choice")
        body._constraint = constraint
    return use


def _jobs(engine: EngineClient, body: CompletionRequest | ChatCompletionRequest,
          is_chat: bool) -> list[tuple[list[int], object]]:
    """(prompt token ids, SamplingParams) per choice: ``n`` per prompt, each checked as the
    engine checks it. Text is tokenized here, once, as the engine would tokenize it."""
    tokenizer, vocab_size, max_model_len = engine.info.tokenizer, engine.info.vocab_size, engine.info.max_model_len
    if is_chat:
        try:
            tools = prompt_tools(body.tools, body.tool_choice)
            messages = [{**(m.model_extra or {}), "role": m.role, "content": m.text()} for m in body.messages]
            prompts = [tokenizer.encode_chat(template_messages(messages), body.chat_template_kwargs, tools)]
        except ToolError as e:
            raise RequestError(str(e), param=e.param) from None
        except ValueError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise RequestError(str(e), param=param) from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requested = body.max_completion_tokens or body.max_tokens
    else:
        prompts = body.prompts()
        logprobs = body.logprobs
        requested = body.max_tokens
        if body.echo and body.logprobs is not None:
            raise RequestError("echo with logprobs is not supported", param="echo")
    jobs = []
    for prompt in prompts:
        prompt = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
        # Chat defaults to the rest of the context, as vLLM does; completions to 16, as OpenAI.
        max_tokens = max(max_model_len - len(prompt), 1) if requested is None else requested
        params = body.sampling_params(max_tokens, logprobs, 0)
        try:
            check_request(prompt, params, vocab_size, max_model_len)
        except RejectedRequest as e:
            raise RequestError(str(e), param=_param_name(e.param, body, is_chat), code=e.code) from None
        jobs.extend((prompt, body.sampling_params(max_tokens, logprobs, index)) for index in range(body.n))
    return jobs


def _param_name(param: str | None, body: CompletionRequest | ChatCompletionRequest, is_chat: bool) -> str | None:
    """The request field an engine refusal names, as this endpoint calls it."""
    if is_chat and param == "prompt":
        return "messages"
    if is_chat and param == "max_tokens" and body.max_completion_tokens:
        return "max_completion_tokens"
    return param


async def _collect(stream: RequestStream, metrics: ServerMetrics) -> RequestCollector:
    async for delta in stream:
        metrics.record_delta(delta, stream.collector)
    return stream.collector


def _usage(finals: list[RequestCollector]) -> dict:
    # A prompt counts once however many choices share it, as OpenAI counts it; its cached tokens
    # are those its first choice found (the others find the whole prompt, just computed).
    prompts: dict[tuple[int, ...], tuple[int, int]] = {}
    for r in finals:
        prompts.setdefault(tuple(r.prompt_token_ids), (len(r.prompt_token_ids), r.metrics.num_cached_tokens))
    prompt_tokens = sum(n for n, _ in prompts.values())
    completion = sum(len(r.token_ids) for r in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())}}


class _CompletionRender:
    def __init__(self, engine: EngineClient, body: CompletionRequest) -> None:
        self.tokenizer = engine.info.tokenizer
        self.body = body
        self.prompts = [prompt for prompt in body.prompts() for _ in range(body.n)]  # each choice's, as given
        self.offsets = [0] * len(self.prompts)

    def _logprobs(self, index: int, token_ids: list[int], entries) -> dict | None:
        if self.body.logprobs is None:
            return None
        tokens, offsets = [], []
        for token in token_ids:
            piece = self.tokenizer.decode([token])
            offsets.append(self.offsets[index])
            self.offsets[index] += len(piece)
            tokens.append(piece)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [self._top(top) for _, top in entries],
                "text_offset": offsets}

    def _top(self, top: list[tuple[int, float]]) -> dict[str, float]:
        # Keyed by text, as OpenAI's: tokens that decode alike keep the likelier one's value.
        out: dict[str, float] = {}
        for token, logprob in top:
            out.setdefault(self.tokenizer.decode([token]), logprob)
        return out

    def _echo(self, index: int) -> str:
        prompt = self.prompts[index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def choice(self, index: int, request: RequestCollector) -> dict:
        text = (self._echo(index) if self.body.echo else "") + request.text
        return {"index": index, "text": text, "finish_reason": request.finish_reason,
                "logprobs": self._logprobs(index, request.token_ids, request.logprobs or [])}

    def chunk(self, index: int, deltas: list[RequestDelta], is_first: bool) -> dict:
        text = (self._echo(index) if self.body.echo and is_first else "") + "".join(d.new_text for d in deltas)
        return {"index": index, "text": text, "finish_reason": deltas[-1].finish_reason,
                "logprobs": self._logprobs(index, *_tokens_and_logprobs(deltas))}

    object_name = "text_completion"


class _ChatRender:
    def __init__(self, engine: EngineClient, body: ChatCompletionRequest, tool_use: ToolUse | None = None) -> None:
        self.tokenizer = engine.info.tokenizer
        self.body = body
        self.tool_use = tool_use
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice
        self._num_streamed_calls: dict[int, int] = {}

    def _logprobs(self, token_ids: list[int], entries) -> dict | None:
        if not self.body.logprobs:
            return None

        def item(token: int, logprob: float) -> dict:
            piece = self.tokenizer.decode([token])
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

        return {"content": [{**item(token, lp), "top_logprobs": [item(t, v) for t, v in top]}
                            for token, (lp, top) in zip(token_ids, entries)]}

    def choice(self, index: int, request: RequestCollector) -> dict:
        message: dict = {"role": "assistant", "content": request.text}
        finish_reason = request.finish_reason
        if self.tool_use is not None:
            parsed = self.tool_use.parse(request.text)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = message_calls(parsed)
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": index, "message": message, "finish_reason": finish_reason,
                "logprobs": self._logprobs(request.token_ids, request.logprobs or [])}

    def chunk(self, index: int, deltas: list[RequestDelta], is_first: bool) -> dict:
        text = "".join(d.new_text for d in deltas)
        finish_reason = deltas[-1].finish_reason
        calls: list[dict] = []
        if self.tool_use is not None:
            text, calls = self._tool_pieces(index, text, finish_reason is not None)
            if finish_reason == "stop" and self._num_streamed_calls.get(index):
                finish_reason = "tool_calls"
        message = {"role": "assistant", "content": text} if is_first else {"content": text}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "delta": message, "finish_reason": finish_reason,
                "logprobs": self._logprobs(*_tokens_and_logprobs(deltas))}

    def _tool_pieces(self, index: int, text: str, is_last: bool) -> tuple[str, list[dict]]:
        """This chunk's content and ``delta.tool_calls`` of choice ``index``, its reply parsed as
        it streams (one call only without ``parallel_tool_calls``)."""
        stream = self._tool_streams.setdefault(index, self.tool_use.parser.stream())
        content, deltas = stream.feed(text)
        if is_last:
            more, late = stream.finish()
            content, deltas = content + more, deltas + late
        calls = []
        for delta in deltas:
            if delta.index > 0 and not self.tool_use.is_parallel:
                continue
            if delta.name is not None:
                self._num_streamed_calls[index] = delta.index + 1
                calls.append({"index": delta.index, "id": delta.id, "type": "function",
                              "function": {"name": delta.name, "arguments": ""}})
            else:
                calls.append({"index": delta.index, "function": {"arguments": delta.arguments}})
        return content, calls

    object_name = "chat.completion.chunk"


def _tokens_and_logprobs(deltas: list[RequestDelta]) -> tuple[list[int], list]:
    return ([token for d in deltas for token in d.new_token_ids],
            [entry for d in deltas for entry in d.new_logprobs or []])


async def _sse(streams: list[RequestStream], render, metrics: ServerMetrics, request_id: str, created: int,
               body: CompletionRequest | ChatCompletionRequest) -> AsyncIterator[str]:
    """Server-sent events: a chunk per choice for the tokens that arrived together (one token a
    chunk while the client keeps up, several once it falls behind), then usage when asked, then
    ``[DONE]``. Leaving early (the client went away) aborts every choice's request."""
    is_started = [False] * len(streams)
    base = {"id": request_id, "object": render.object_name, "created": created, "model": body.model}
    try:
        async for batch in merge_streams(streams):
            by_choice: dict[int, list[RequestDelta]] = {}
            for index, item in batch:
                if isinstance(item, EngineError):
                    yield f"data: {json.dumps(error_body(str(item), 'internal_error'))}\n\n"
                    return
                metrics.record_delta(item, streams[index].collector)
                by_choice.setdefault(index, []).append(item)
            for index, deltas in by_choice.items():
                is_first, is_started[index] = not is_started[index], True
                yield f"data: {json.dumps({**base, 'choices': [render.chunk(index, deltas, is_first)]})}\n\n"
        if body.include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': _usage([s.collector for s in streams])})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for stream in streams:
            stream.close()


class _ApiKeyMiddleware:
    """Refuses ``/v1`` requests without ``Authorization: Bearer <api_key>``. A plain ASGI
    middleware: Starlette's ``BaseHTTPMiddleware`` would pass every streamed chunk through a
    stream of its own."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(header, self.expected):
                response = JSONResponse(error_body("invalid or missing API key", "authentication_error",
                                                   code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM and SIGINT end ``run`` normally after the graceful
    shutdown (uvicorn re-raises them, and the process would die of the signal, not exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app: FastAPI, host: str, port: int, graceful_timeout: float, log_level: str = "warning") -> None:
    """Serve ``app`` until SIGTERM or SIGINT: then stop accepting, let running requests finish
    within ``graceful_timeout`` seconds, and return."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout)
    _Server(config).run()


__all__ = ["ServerConfig", "build_fastapi_app", "serve", "MAX_LOGPROBS"]
