"""A worker killed mid-run: its in-flight streams end cleanly (an error event, then [DONE]), the other
worker's streams finish, and every later request succeeds on the surviving worker through both gateways."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.store import open_store
from tests.gateway.scale_out_stack import SECRET_HEADERS, completion, post_all, start_gateways, start_stack

pytestmark = pytest.mark.slow

STREAMS = 8
LONG_TOKENS = 400


def prompt(i: int) -> list[int]:
    return [(13 * i + k) % 200 + 20 for k in range(32)]


async def stream_one(client: httpx.AsyncClient, url: str, key: str, i: int, first: asyncio.Event) -> dict:
    body = completion(prompt(i), max_tokens=LONG_TOKENS, stream=True, ignore_eos=True)
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            first.set()
            return {"status": resp.status_code, "body": (await resp.aread()).decode()}
        events = []
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                first.set()
        return {"status": 200, "events": events}


async def run_streams_and_kill(gateways, workers, key) -> list[dict]:
    doomed = workers[0]
    async with httpx.AsyncClient(timeout=httpx.Timeout(60), limits=httpx.Limits(max_connections=50)) as client:
        firsts = [asyncio.Event() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(stream_one(client, gateways[i % 2].url, key, i, firsts[i]))
                 for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
        state = (await client.get(doomed.url + "/state", headers=SECRET_HEADERS)).json()
        assert state["num_running"] > 0, "no stream landed on the worker about to be killed"
        await asyncio.to_thread(doomed.kill)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)  # nothing hangs


def test_killed_worker_fails_its_streams_cleanly_and_the_other_takes_over(make_model, tmp_path_factory):
    model = make_model("llama")
    root = tmp_path_factory.mktemp("failover")
    stack = start_stack(model, root)
    try:
        gateways = start_gateways(stack, model, root, "cache_aware")
        store = open_store(stack.redis_url)
        tenant = store.create_tenant("failover", policy={"requests_per_minute": 10_000,
                                                         "max_concurrent_requests": 100})
        key = store.create_api_key(tenant.id)[0]
        store.close()

        results = asyncio.run(run_streams_and_kill(gateways, stack.workers, key))
        failed = finished = 0
        for result in results:
            assert result["status"] == 200, result
            events = result["events"]
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            if "error" in last:  # the killed worker's streams: one error event, then [DONE]
                failed += 1
                assert last["error"]["code"] == "engine_error", last
            else:
                finished += 1
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
                assert last["choices"][0]["finish_reason"] == "length", last
                assert text
        assert failed >= 1 and failed + finished == STREAMS, (failed, finished)

        before = httpx.get(stack.workers[1].url + "/state", headers=SECRET_HEADERS).json()
        later = [(gateways[i % 2].url, key, completion(prompt(i), max_tokens=4)) for i in range(2 * STREAMS)]
        responses = asyncio.run(asyncio.wait_for(post_all(later, concurrency=4), 60))
        assert [r.status_code for r in responses] == [200] * len(later), [r.text for r in responses
                                                                          if r.status_code != 200][:2]
        after = httpx.get(stack.workers[1].url + "/state", headers=SECRET_HEADERS).json()
        looked_up = after["prefix_query_tokens"] - before["prefix_query_tokens"]
        assert looked_up >= len(later) * 16, looked_up  # every one ran there (a 16-token block looked up each)
    finally:
        stack.stop()
