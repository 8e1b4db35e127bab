"""`RequestStream` coalescing: a reader that fell behind gets the newest waiting output (they are
cumulative), never skips the final output or an error, and gets the outputs before an error
first. Negative control: outputs that arrive one at a time, each read before the next, are each
yielded."""

from __future__ import annotations

import asyncio

from specdec.core.snapshot import EngineDeadError
from specdec.engine.outputs import CompletionOutput, RequestOutput
from specdec.server.async_engine import RequestStream


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def output(tokens: int, finished: bool = False) -> RequestOutput:
    text = "".join(f" t{i}" for i in range(tokens))
    sample = CompletionOutput(0, text, list(range(tokens)), "length" if finished else None)
    return RequestOutput("r", None, [1, 2], [sample], finished, seed=0)


async def read(stream: RequestStream) -> list:
    seen = []
    try:
        async for item in stream:
            seen.append(len(item.outputs[0].token_ids))
    except EngineDeadError as err:
        seen.append(str(err))
    return seen


def test_a_reader_behind_gets_the_newest_output():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for n in (1, 2, 3):
            queue.put_nowait(output(n))
        queue.put_nowait(output(4, finished=True))
        stream = RequestStream(_Engine(), "r", queue)
        return await read(stream), stream.coalesced

    seen, coalesced = asyncio.run(run())
    assert seen == [4]  # the final output, holding every token
    assert coalesced == 3


def test_the_outputs_before_an_error_come_first():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for item in (output(1), output(2), EngineDeadError("gone"), output(9)):
            queue.put_nowait(item)
        return await read(RequestStream(_Engine(), "r", queue))

    assert asyncio.run(run()) == [2, "gone"]


def test_outputs_read_as_they_come_are_each_yielded():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(_Engine(), "r", queue)
        seen = []

        async def produce():
            for n in (1, 2, 3):
                queue.put_nowait(output(n, finished=n == 3))
                await asyncio.sleep(0.01)  # the reader takes each before the next

        producer = asyncio.ensure_future(produce())
        async for item in stream:
            seen.append(len(item.outputs[0].token_ids))
        await producer
        return seen, stream.coalesced

    assert asyncio.run(run()) == ([1, 2, 3], 0)


def test_a_finished_output_ends_the_stream():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(output(2, finished=True))
        queue.put_nowait(output(3))  # never read: the stream ended
        return await read(RequestStream(_Engine(), "r", queue))

    assert asyncio.run(run()) == [2]
