"""Scheduler on CPU with a fake runner: budgets, priority, preemption order, release of everything."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import EngineConfig
from engine.request import Request, RequestStatus
from engine.scheduler import BASE_SLOT, Scheduler
from tests.engine.fake_runner import FakeRunner
from wire.sampling import SamplingParams


def make_scheduler(num_blocks=32, block_size=4, prefix=True, **kw) -> Scheduler:
    cfg = EngineConfig(model="unused", block_size=block_size, enable_prefix_caching=prefix, **kw)
    return Scheduler(cfg, num_blocks, max_model_len=4096)


def req(rid, n_prompt=8, max_tokens=4, priority=0, arrival=None, base=1):
    r = Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                priority=priority)
    if arrival is not None:
        r.arrival_time = arrival
    return r


def run(s: Scheduler, runner: FakeRunner, max_steps=1000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        plan = s.schedule()
        s.update(plan, runner.execute(plan))
        s.check_integrity()
    raise AssertionError("did not finish")


def test_token_budget_chunks_prefill_and_mixes_decode():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=10)
    runner = FakeRunner()
    s.add_request(req("a", n_prompt=3, max_tokens=5))
    plan = s.schedule()
    s.update(plan, runner.execute(plan))
    s.add_request(req("b", n_prompt=25, max_tokens=2, base=50))
    plan = s.schedule()
    assert [(q.req_id, q.query_len) for q in plan.seqs] == [("a", 1), ("b", 9)]  # decode + a prefill chunk
    assert [r.req_id for r in plan.sample_rows] == ["a"]  # b's chunk does not reach its last token
    s.update(plan, runner.execute(plan))
    run(s, runner)


def test_admission_gates_run_in_order_and_a_waiting_answer_stops_the_rest():
    calls = []

    def looks(r: Request, active_slots: set[int]) -> int | None:
        calls.append(("looks", r.request_id))
        return None if r.request_id == "b" else BASE_SLOT  # b waits (say, its grammar compiles)

    def places(r: Request, active_slots: set[int]) -> int | None:
        calls.append(("places", r.request_id, frozenset(active_slots)))
        return 3  # the slot it runs in (say, its adapter's)

    cfg = EngineConfig(model="unused", block_size=4)
    released: list[str] = []
    s = Scheduler(cfg, 32, max_model_len=4096, gates=(looks, places),
                  on_release=lambda r: released.append(r.request_id))
    s.add_request(req("a", arrival=1.0))
    s.add_request(req("b", arrival=2.0, base=40))
    s.add_request(req("c", arrival=3.0, base=70))
    plan = s.schedule()
    assert calls == [("looks", "a"), ("places", "a", frozenset()), ("looks", "b"),
                     ("looks", "c"), ("places", "c", frozenset({3}))]
    assert [(q.req_id, q.lora_slot) for q in plan.seqs] == [("a", 3), ("c", 3)]
    assert [r.request_id for r in s.waiting] == ["b"]
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert released == ["b"]


def test_priority_then_arrival_order_and_max_num_seqs():
    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i, (rid, prio, t) in enumerate([("late-hi", 0, 3.0), ("early-lo", 5, 1.0), ("early-hi", 0, 2.0)]):
        s.add_request(req(rid, priority=prio, arrival=t, base=100 * i))  # distinct prompts: no prefix waits
    plan = s.schedule()
    assert [q.req_id for q in plan.seqs] == ["early-hi", "late-hi"]


def test_preemption_takes_lowest_priority_latest_arrival_first_and_recomputes():
    s = make_scheduler(num_blocks=6, block_size=4, prefix=False)
    runner = FakeRunner()
    s.add_request(req("a", n_prompt=7, max_tokens=8, priority=0, arrival=1.0, base=1))
    s.add_request(req("b", n_prompt=7, max_tokens=8, priority=1, arrival=0.5, base=30))
    s.add_request(req("c", n_prompt=3, max_tokens=8, priority=1, arrival=2.0, base=60))
    finished = {}
    preempted_ids = []
    while s.has_unfinished():
        plan = s.schedule()
        if plan.num_preempted:
            preempted_ids += [r.request_id for r in s.waiting if r.status == RequestStatus.PREEMPTED]
        for r, _ in s.update(plan, runner.execute(plan)):
            if r.status.finished:
                finished[r.request_id] = list(r.output_token_ids)
        s.check_integrity()
    assert preempted_ids and preempted_ids[0] == "c"  # priority 1 and the latest arrival
    # recompute gives the same tokens as running alone
    for rid, n, base, prio in [("a", 7, 1, 0), ("b", 7, 30, 1), ("c", 3, 60, 1)]:
        alone = make_scheduler(num_blocks=64, prefix=False)
        alone.add_request(req(rid, n_prompt=n, max_tokens=8, base=base, priority=prio))
        r = alone.requests[rid]
        run(alone, FakeRunner())
        assert finished[rid] == r.output_token_ids
    assert s.kv.num_free_blocks == 6


def test_abort_releases_blocks_waiting_and_running():
    s = make_scheduler(num_blocks=16, prefix=False)
    s.add_request(req("a", n_prompt=9))
    s.add_request(req("b", n_prompt=9, base=40))
    plan = s.schedule()
    s.update(plan, FakeRunner().execute(plan))
    s.add_request(req("c"))
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.finish_request("c", RequestStatus.FINISHED_ABORTED)
    s.finish_request("nope", RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert set(s.requests) == {"b"}
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 16
    assert {"a", "b", "c"} <= s.schedule().finished_req_ids


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 20, 21], [1, 2, 3, 4, 30], [40, 41, 42, 43, 44, 45]]


class SchedulerMachine(RuleBasedStateMachine):
    """Any mix of add / step / abort / evict keeps every block accounted for."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix = True
        self.s = make_scheduler(num_blocks=12, block_size=4, prefix=self.prefix, max_num_batched_tokens=16)
        self.runner = FakeRunner()
        self.ids = itertools.count()

    @rule(prompt=st.sampled_from(PROMPTS), extra=st.integers(0, 6), max_tokens=st.integers(1, 12),
          priority=st.integers(0, 2), salt=st.sampled_from(["", "tenant-b"]))
    def add(self, prompt, extra, max_tokens, priority, salt):
        r = Request(f"r{next(self.ids)}", prompt + [50 + extra] * extra,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority, cache_salt=salt)
        self.s.add_request(r)

    @precondition(lambda self: self.s.has_unfinished())
    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            plan = self.s.schedule()
            self.s.update(plan, self.runner.execute(plan))

    @precondition(lambda self: self.s.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        if self.s.kv.prefix_cache is not None:
            self.s.kv.prefix_cache.evict(n)

    @invariant()
    def integrity(self):
        self.s.check_integrity()

    def teardown(self):
        for rid in list(self.s.requests):
            self.s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        if self.s.kv.prefix_cache is not None:
            self.s.kv.prefix_cache.flush()
            assert self.s.kv.prefix_cache.num_blocks == 0
        self.s.check_integrity()
        assert self.s.kv.num_free_blocks == 12


class SchedulerMachineNoPrefixCache(SchedulerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = make_scheduler(num_blocks=12, block_size=4, prefix=False, max_num_batched_tokens=16)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSchedulerMachineNoPrefixCache = SchedulerMachineNoPrefixCache.TestCase
TestSchedulerMachineNoPrefixCache.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("prefix", [True, False])
def test_unservable_sequence_ends_cleanly(prefix):
    s = make_scheduler(num_blocks=3, block_size=4, prefix=prefix)
    s.add_request(req("a", n_prompt=8, max_tokens=50))
    run(s, FakeRunner())
    assert s.kv.num_free_blocks + (s.kv.prefix_cache.num_blocks if s.kv.prefix_cache else 0) == 3


def _prompt_tokens_computed(s: Scheduler, runner: FakeRunner) -> int:
    total = 0
    for _ in range(1000):
        if not s.has_unfinished():
            return total
        plan = s.schedule()
        total += sum(q.query_len for q in plan.seqs if q.query_len > 1)
        s.update(plan, runner.execute(plan))
        s.check_integrity()
    raise AssertionError("did not finish")


def test_requests_sharing_an_uncached_prefix_compute_it_once():
    """Arriving together, the second request waits for the first's prefill to put the shared blocks in
    the prefix cache rather than computing them too; a different namespace (another tenant's salt) and a
    prefix shorter than a block are not held back."""
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    shared = list(range(100, 124))  # 6 blocks
    a = Request("a", shared + [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    b = Request("b", shared + [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    s.add_request(a)
    s.add_request(b)
    plan = s.schedule()
    assert [q.req_id for q in plan.seqs] == ["a"] and s.stats.num_prefix_waits == 1
    s.update(plan, FakeRunner().execute(plan))
    plan = s.schedule()
    assert ("b", 3) in [(q.req_id, q.query_len) for q in plan.seqs]  # only its own tokens: 24 came from the cache
    s.update(plan, FakeRunner().execute(plan))
    run(s, FakeRunner())
    assert b.num_cached_tokens == 24

    other = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    c = Request("c", shared + [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    d = Request("d", shared + [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), cache_salt="another tenant")
    e = Request("e", shared[:3] + [9], SamplingParams(max_tokens=2, ignore_eos=True))  # under one whole block
    for r in (c, d, e):
        other.add_request(r)
    assert {q.req_id for q in other.schedule().seqs} == {"c", "d", "e"}
    assert other.stats.num_prefix_waits == 0


def test_held_back_requests_still_finish_with_chunked_prefill_and_preemption():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=20)
    runner = FakeRunner()
    shared = list(range(200, 232))  # 8 blocks, computed over several chunks
    reqs = [Request(f"r{i}", shared + [i, i + 1], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    computed = _prompt_tokens_computed(s, runner)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert s.stats.num_prefix_waits > 0
    assert computed < 5 * len(shared)  # the shared blocks were not computed by every request
