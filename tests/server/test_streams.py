"""Streams on the consumer's side: deltas that arrive while the consumer is busy are handed on
together, and the server folds them into one chunk per choice, losing nothing."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from fastdraft.engine.output import RequestDelta
from fastdraft.server.app import _CompletionRender, _sse
from fastdraft.server.engine_client import RequestStream, merge_streams
from fastdraft.server.prometheus import ServerMetrics
from fastdraft.server.protocol import CompletionRequest


class _Engine:
    info = SimpleNamespace(tokenizer=None)

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _delta(request_id: str, token: int, finish: str | None = None) -> RequestDelta:
    return RequestDelta(request_id, [token], f"<{token}>", finish_reason=finish)


def test_merge_streams_hands_on_what_arrived_together_in_order():
    async def run():
        engine = _Engine()
        streams = [RequestStream(engine, "a", [1]), RequestStream(engine, "b", [1])]
        for delta in (_delta("a", 1), _delta("a", 2)):
            streams[0].queue.put_nowait(delta)
        streams[1].queue.put_nowait(_delta("b", 7))
        batches = []
        merged = merge_streams(streams)
        batches.append(await anext(merged))
        streams[0].queue.put_nowait(_delta("a", 3, "length"))  # later, alone
        batches.append(await anext(merged))
        streams[1].queue.put_nowait(_delta("b", 8, "stop"))
        batches.append(await anext(merged))
        return [[(index, delta.new_token_ids[0]) for index, delta in batch] for batch in batches], engine

    batches, engine = asyncio.run(run())
    assert batches == [[(0, 1), (0, 2), (1, 7)], [(0, 3)], [(1, 8)]]
    assert engine.aborted == []


def test_a_consumer_that_fell_behind_gets_one_chunk_per_choice_with_every_token():
    async def run():
        engine = _Engine()
        body = CompletionRequest(model="m", prompt="x", stream=True, n=2,
                                 stream_options={"include_usage": True})
        streams = [RequestStream(engine, f"r-{i}", [1]) for i in range(2)]
        for token in range(3):
            streams[0].queue.put_nowait(_delta("r-0", token))
        streams[1].queue.put_nowait(_delta("r-1", 9, "stop"))
        events = _sse(streams, _CompletionRender(engine, body), ServerMetrics("m"), "cmpl-1", 0, body)
        out = [await anext(events), await anext(events)]
        streams[0].queue.put_nowait(_delta("r-0", 3, "length"))
        out += [event async for event in events]
        return out

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
             for c in chunks if c["choices"]]
    assert texts == [(0, "<0><1><2>", None), (1, "<9>", "stop"), (0, "<3>", "length")]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
