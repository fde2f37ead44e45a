"""FairQueue with a simulated worker of capacity 1: DRR fairness, weights, priority, bounds, cancellation."""

from __future__ import annotations

import asyncio
import random

import pytest

from policies.fair_queue import FairQueue, FairQueueConfig, QueueFull, QueueTimeout


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def serve(queue: FairQueue, finished: list[str], tenant: str, priority: int = 1, weight: float = 1.0,
                cost: int = 100, actual: int | None = None) -> None:
    ticket = await queue.acquire(tenant, priority, weight, cost, timeout=30)
    await asyncio.sleep(0)  # the "worker" runs the request
    finished.append(tenant)
    queue.release(ticket, cost if actual is None else actual)


def test_late_tenant_is_interleaved_with_a_backlogged_one():
    async def scenario() -> tuple[int, list[str]]:
        queue = FairQueue(FairQueueConfig(capacity=1, max_queued_per_tenant=200))
        finished: list[str] = []
        a_tasks = [asyncio.create_task(serve(queue, finished, "A")) for _ in range(100)]
        await settle()
        assert queue.depth_by_tenant()["A"] >= 90
        b_arrival = len(finished)
        b_tasks = [asyncio.create_task(serve(queue, finished, "B")) for _ in range(10)]
        await asyncio.gather(*a_tasks, *b_tasks)
        return b_arrival, finished

    b_arrival, finished = asyncio.run(scenario())
    after = finished[b_arrival:]
    b_last = max(i for i, tenant in enumerate(after) if tenant == "B")
    a_before_b_last = after[:b_last].count("A")
    assert a_before_b_last < 25, f"B's last finished after {a_before_b_last} of A's"
    assert after[:b_last + 1].count("B") == 10


@pytest.mark.parametrize("actual_range", [(256, 256), (32, 256)])
def test_weights_3_to_1_split_completed_tokens_75_25(actual_range):
    async def scenario() -> dict[str, int]:
        queue = FairQueue(FairQueueConfig(capacity=1, quantum_tokens=256))
        rng = random.Random(7)
        tokens = {"A": 0, "B": 0}
        completions = 0
        done = asyncio.Event()

        async def client(tenant: str, weight: float) -> None:
            nonlocal completions
            while True:
                ticket = await queue.acquire(tenant, 1, weight, 256, timeout=30)
                await asyncio.sleep(0)
                actual = rng.randint(*actual_range)
                tokens[tenant] += actual
                completions += 1
                if completions >= 600:
                    done.set()
                queue.release(ticket, actual)

        clients = [asyncio.create_task(client(t, w)) for t, w in (("A", 3.0), ("B", 1.0)) for _ in range(6)]
        await done.wait()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        assert queue.in_flight == 0 and queue.waiting == 0, "cancelled clients leaked queue state"
        return tokens

    tokens = asyncio.run(scenario())
    share_a = tokens["A"] / (tokens["A"] + tokens["B"])
    assert abs(share_a - 0.75) <= 0.075, share_a


def test_token_fairness_uses_actual_cost_not_the_estimate():
    async def scenario() -> dict[str, int]:
        queue = FairQueue(FairQueueConfig(capacity=1, quantum_tokens=100))
        tokens = {"A": 0, "B": 0}
        stop = asyncio.Event()

        async def client(tenant: str, actual: int) -> None:
            while not stop.is_set():
                ticket = await queue.acquire(tenant, 1, 1.0, 100, timeout=30)
                await asyncio.sleep(0)
                tokens[tenant] += actual
                if sum(tokens.values()) >= 20_000:
                    stop.set()
                queue.release(ticket, actual)

        await asyncio.gather(*[client("A", 25) for _ in range(4)], *[client("B", 100) for _ in range(4)])
        return tokens

    tokens = asyncio.run(scenario())
    share_a = tokens["A"] / sum(tokens.values())
    assert abs(share_a - 0.5) <= 0.05, share_a  # without refunds A would get 0.2


def test_priority_0_overtakes_queued_priority_2():
    async def scenario() -> list[str]:
        queue = FairQueue(FairQueueConfig(capacity=1))
        finished: list[str] = []
        blocker = await queue.acquire("x", 5)
        low = [asyncio.create_task(serve(queue, finished, f"low{i}", priority=2)) for i in range(5)]
        await settle()
        high = [asyncio.create_task(serve(queue, finished, f"high{i}", priority=0)) for i in range(3)]
        await settle()
        assert queue.depth_by_priority() == {0: 3, 2: 5}
        queue.release(blocker)
        await asyncio.gather(*low, *high)
        return finished

    assert asyncio.run(scenario()) == ["high0", "high1", "high2", "low0", "low1", "low2", "low3", "low4"]


def test_bounds_per_tenant_and_total():
    async def scenario() -> None:
        queue = FairQueue(FairQueueConfig(capacity=1, max_total_queued=3, max_queued_per_tenant=2))
        held = await queue.acquire("a", 1)
        waiters = [asyncio.create_task(queue.acquire("a", 1)) for _ in range(2)]
        await settle()
        with pytest.raises(QueueFull) as tenant_full:
            await queue.acquire("a", 1)
        assert tenant_full.value.scope == "tenant" and tenant_full.value.retry_after_s >= 1.0
        waiters.append(asyncio.create_task(queue.acquire("b", 1)))
        await settle()
        with pytest.raises(QueueFull) as total_full:
            await queue.acquire("c", 1, max_queued=10)
        assert total_full.value.scope == "total"
        queue.release(held)
        for task in waiters:
            queue.release(await task)
        assert queue.in_flight == 0 and queue.waiting == 0
    asyncio.run(scenario())


def test_timeout_removes_the_waiter_and_carries_retry_after():
    async def scenario() -> None:
        queue = FairQueue(FairQueueConfig(capacity=1, min_retry_after_s=2.0))
        held = await queue.acquire("a", 1)
        with pytest.raises(QueueTimeout, match="waited 0.050s") as timeout:
            await queue.acquire("b", 1, timeout=0.05)
        assert timeout.value.retry_after_s >= 2.0
        assert queue.waiting == 0 and queue.depth_by_tenant() == {}
        queue.release(held)
        assert queue.in_flight == 0
    asyncio.run(scenario())


def test_cancel_while_waiting_and_cancel_at_the_grant_instant_leak_nothing():
    async def scenario() -> None:
        queue = FairQueue(FairQueueConfig(capacity=1))
        held = await queue.acquire("a", 1)
        waiting = asyncio.create_task(queue.acquire("b", 1))
        granted_then_cancelled = asyncio.create_task(queue.acquire("c", 1))
        await settle()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert queue.depth_by_tenant() == {"c": 1}
        assert queue.release(held)
        assert not queue.release(held), "release is idempotent"
        assert queue.in_flight == 1  # granted to c, whose task has not run yet
        granted_then_cancelled.cancel()
        await asyncio.gather(granted_then_cancelled, return_exceptions=True)
        assert queue.in_flight == 0 and queue.waiting == 0
        ticket = await asyncio.wait_for(queue.acquire("d", 1), timeout=1)
        queue.release(ticket)
    asyncio.run(scenario())


def test_set_capacity_releases_waiters_and_validates_arguments():
    async def scenario() -> None:
        queue = FairQueue(FairQueueConfig(capacity=0))
        tasks = [asyncio.create_task(queue.acquire("a", 1)) for _ in range(3)]
        await settle()
        assert queue.waiting == 3 and queue.in_flight == 0
        queue.set_capacity(2)
        await settle()
        assert queue.in_flight == 2 and queue.waiting == 1
        for bad in ({"weight": 0}, {"cost_estimate": -1}, {"timeout": 0}):
            with pytest.raises(ValueError, match=next(iter(bad))):
                await queue.acquire("a", 1, **bad)
        with pytest.raises(ValueError, match="capacity"):
            queue.set_capacity(-1)
        tasks[2].cancel()
        await asyncio.gather(tasks[2], return_exceptions=True)
        for task in tasks[:2]:
            queue.release(task.result())
        assert queue.in_flight == 0 and queue.waiting == 0
    asyncio.run(scenario())
