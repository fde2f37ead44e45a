"""A client that goes away aborts its engine request, and every KV block comes back."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from tests.gateway.conftest import BASE_MODEL, wait_until

LONG = {"model": BASE_MODEL, "max_tokens": 1500, "ignore_eos": True,
        "messages": [{"role": "user", "content": "tell me everything"}]}


def _engine_idle(stack) -> bool:
    return not stack.llm.engine.has_unfinished_requests() and stack.llm.stats().num_running == 0


def _check_blocks(stack) -> None:
    async def check():
        return await stack.llm.call_in_loop(lambda engine: engine.scheduler.check_integrity())

    asyncio.run(check())
    stats = stack.llm.stats()
    # Every block is free or held by the prefix cache; nothing is owned by a request any more.
    assert stats.num_free_kv_blocks >= stats.num_kv_blocks - stats.prefix_cache_blocks


def _usage(stack):
    return stack.store.usage_totals(stack.tenant_b, 0, time.time() + 3600)


def test_disconnecting_a_stream_aborts_the_engine_request(gateway_stack):
    before = _usage(gateway_stack)
    headers = {"authorization": f"Bearer {gateway_stack.key_b}"}
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", gateway_stack.v1 + "/chat/completions", headers=headers, json={**LONG, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "chat.completion.chunk" in first
        assert gateway_stack.llm.stats().num_running == 1
    assert wait_until(lambda: _engine_idle(gateway_stack), timeout_s=10)
    _check_blocks(gateway_stack)
    # The partial request is still accounted: one request, fewer tokens than asked for.
    assert wait_until(lambda: _usage(gateway_stack).requests == before.requests + 1)
    used = _usage(gateway_stack).completion_tokens - before.completion_tokens
    assert 1 <= used < 1500


def test_disconnecting_while_waiting_for_a_non_streamed_answer_aborts_too(gateway_stack):
    headers = {"authorization": f"Bearer {gateway_stack.key_b}"}

    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(http.post(gateway_stack.v1 + "/chat/completions", headers=headers, json=LONG))
            for _ in range(500):
                await asyncio.sleep(0.01)
                if gateway_stack.llm.stats().num_running == 1:
                    break
            assert gateway_stack.llm.stats().num_running == 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert wait_until(lambda: _engine_idle(gateway_stack), timeout_s=10)
    _check_blocks(gateway_stack)
