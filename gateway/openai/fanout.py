"""One answer from several engine requests: a completions request with a list of prompts.

Each prompt is its own engine request (its own prefix-cache match, its own n samples); their delta
streams are merged as they come into one stream in which prompt i's sample j is choice i * n + j, as
OpenAI numbers them. A merged delta carries the prompts' summed token counts, and the last one is
finished when every prompt's stream is. A failure of any stream fails the whole answer; leaving the
iteration closes every stream (which aborts their requests).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from wire.protocol import GenerateDelta, SampleDelta

_DONE = object()


def merge_deltas(streams: list[AsyncIterator[GenerateDelta]], n: int, request_id: str) -> AsyncIterator[GenerateDelta]:
    """The streams' deltas as one stream (see the module note); one stream is returned as it is."""
    return streams[0] if len(streams) == 1 else _merged(streams, n, request_id)


async def _merged(streams: list[AsyncIterator[GenerateDelta]], n: int, request_id: str) -> AsyncIterator[GenerateDelta]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[GenerateDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
        except Exception as e:  # a RequestError (or a fault): the whole answer fails with it
            await queue.put((i, e))
        await queue.put((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    prompt_tokens, cached = [0] * len(streams), [0] * len(streams)
    unfinished = len(streams)
    try:
        while unfinished:
            i, item = await queue.get()
            if item is _DONE:
                continue
            if isinstance(item, Exception):
                raise item
            prompt_tokens[i] = item.num_prompt_tokens
            cached[i] = max(cached[i], item.num_cached_tokens)
            unfinished -= item.finished
            samples = [SampleDelta(i * n + s.index, s.token_ids, s.text, s.logprobs, s.finish_reason, s.stop_reason)
                       for s in item.samples]
            yield GenerateDelta(request_id, samples, sum(prompt_tokens), sum(cached), finished=unfinished == 0)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]
