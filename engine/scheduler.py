"""Iteration-level scheduling: which tokens of which requests run in the next forward pass.

The scheduler owns no tensors. It composes a waiting queue (priority, then arrival), a running set in
the same order, and the KV cache manager (block pool + radix prefix cache), and hands the runner a
BatchPlan. Each step: running requests continue first (decode or their next prefill chunk) under the
token budget; when KV blocks run out the worst running request (highest priority number, latest
arrival) is preempted by recompute; then waiting requests are admitted while budget, sequence slots and
blocks last, each only once it passes the admission gates it was constructed with (in their order).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.plan import BatchPlan, ModelOutput, SampledToken, SampleRow, ScheduledSeq
from engine.request import Request, RequestStatus

BASE_SLOT = -1  # the LoRA slot of a request that runs the base model alone (ScheduledSeq.lora_slot)

# One check a waiting request passes before it starts, given the LoRA slots running requests use. Returns
# None to keep it waiting this step (later requests still go ahead: its grammar compiles, its adapter is
# read from disk), else the LoRA slot it runs in (BASE_SLOT from a gate that places no adapter). Gates
# run in the order given and the first None stops the rest, so a gate that holds something for the
# request (a LoRA slot pin) goes after the gates that only look.
AdmissionGate = Callable[[Request, set[int]], "int | None"]


class _GateFault(Exception):
    def __init__(self, gate: AdmissionGate, error: Exception) -> None:
        super().__init__(str(error))
        self.gate = gate
        self.error = error


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_prefix_waits: int = 0  # admissions put off a step because a running request computes their prefix


class RequestQueue:
    """Waiting requests in (priority, arrival) order, with removal by identity."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def add(self, req: Request) -> None:
        bisect.insort(self._items, req, key=lambda r: r.sort_key)

    def remove(self, req: Request) -> None:
        self._items.remove(req)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, *,
                 gates: Sequence[AdmissionGate] = (),
                 on_release: Callable[[Request], None] | None = None,
                 holdings_check: Callable[[list[Request]], None] | None = None) -> None:
        """`gates`: admission gates, in the order they run. `on_release(request)` frees what a finished
        request holds outside the KV cache (adapter pins, grammar state); `holdings_check(unfinished)`
        asserts, in check_integrity, that it did."""
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting = RequestQueue()
        self.running: list[Request] = []  # kept in sort_key order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        self._lora_slots: dict[str, int] = {}  # request id -> LoRA slot it was admitted with
        # Requests a gate raised for (request id, the gate, the error): failed and released at once, reported
        # by whoever calls take_admission_faults (the engine), so one request's fault never stops a step.
        self._admission_faults: list[tuple[str, AdmissionGate, Exception]] = []
        self.gates = tuple(gates)
        self.on_release = on_release
        self.holdings_check = holdings_check

    # ----- intake ----------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {req.num_prompt_tokens} tokens; the maximum context is {self.max_model_len}"
            )
        if self.config.blocks_for(req.num_prompt_tokens + 1) > self.kv.pool.num_blocks:
            raise ValueError(f"the prompt does not fit in the KV cache ({self.kv.pool.num_blocks} blocks)")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def finish_request(self, request_id: str, status: RequestStatus, reason: int | str | None = None) -> None:
        """End a request now (abort, stop string, error). Releases all it holds. Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.stop_reason = reason
        self._release(req, status)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----- schedule ---------------------------------------------------------------------------------

    def schedule(self) -> BatchPlan:
        """Choose this step's work. Mutates block tables, queues and preemption state (not tokens)."""
        self.stats.num_steps += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = 0

        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            n = min(req.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    self._drop_unservable(req)
                    break
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                idx += 1

        if preempted == 0:
            budget = self._admit(scheduled, budget)
        self.stats.num_preemptions += preempted
        return self._build_plan(scheduled, preempted)

    def _admit(self, scheduled: list[tuple[Request, int]], budget: int) -> int:
        active_slots = {self._lora_slots.get(r.request_id, BASE_SLOT) for r in self.running} - {BASE_SLOT}
        for req in self.waiting:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            try:
                slot = self._pass_gates(req, active_slots)
            except _GateFault as fault:  # the request's own fault (say, an adapter that cannot be loaded)
                self._fail_admission(req, fault.gate, fault.error)
                continue
            if slot is None:
                continue  # not ready (grammar compiling, adapter loading): others go ahead
            if self.kv.prefix_pending_in(req, self.running):
                # Another running request is computing blocks of this prompt: wait for them to reach the
                # prefix cache instead of computing them twice (SGLang's in-batch prefix caching).
                self.stats.num_prefix_waits += 1
                continue
            cached = self.kv.match_prefix(req)
            req.num_computed_tokens = cached
            n = min(req.num_uncomputed_tokens, budget)
            if not self.kv.allocate_slots(req, n):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            self._lora_slots[req.request_id] = slot
            if slot != BASE_SLOT:
                active_slots.add(slot)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _pass_gates(self, req: Request, active_slots: set[int]) -> int | None:
        """The LoRA slot `req` may start in now, or None while a gate keeps it waiting. A gate that
        raises must hold nothing for `req` (the scheduler then fails the request)."""
        slot = BASE_SLOT
        for gate in self.gates:
            try:
                placed = gate(req, active_slots)
            except Exception as e:  # noqa: BLE001 -- attributed to req by the caller
                raise _GateFault(gate, e) from e
            if placed is None:
                return None
            if placed != BASE_SLOT:
                slot = placed
        return slot

    def _fail_admission(self, req: Request, gate: AdmissionGate, error: Exception) -> None:
        self.waiting.remove(req)
        req.error = "an admission gate failed"
        self._release(req, RequestStatus.FINISHED_ERROR)
        self._admission_faults.append((req.request_id, gate, error))

    def take_admission_faults(self) -> list[tuple[str, AdmissionGate, Exception]]:
        """(request id, gate, error) of requests failed because a gate raised since the last call."""
        faults, self._admission_faults = self._admission_faults, []
        return faults

    def _preempt(self, req: Request) -> None:
        """Recompute later: keep computed whole blocks in the prefix cache, free the rest, re-queue."""
        self.running.remove(req)
        self.kv.cache_computed_blocks(req)
        self.kv.free(req)
        self._lora_slots.pop(req.request_id, None)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.add(req)

    def _drop_unservable(self, req: Request) -> None:
        self.running.remove(req)
        req.error = "the sequence no longer fits in the KV cache"
        self._release(req, RequestStatus.FINISHED_LENGTH)

    def _build_plan(self, scheduled: list[tuple[Request, int]], preempted: int) -> BatchPlan:
        bs = self.config.block_size
        # Group by LoRA slot so the runner sees contiguous adapter segments.
        scheduled.sort(key=lambda item: self._lora_slots.get(item[0].request_id, BASE_SLOT))
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[ScheduledSeq] = []
        rows: list[SampleRow] = []
        for req, n in scheduled:
            start = req.num_computed_tokens
            query_start = len(token_ids)
            token_ids.extend(req.tokens_between(start, start + n))
            positions.extend(range(start, start + n))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            seqs.append(ScheduledSeq(req.request_id, query_start, n, start + n, list(table),
                                     self._lora_slots.get(req.request_id, BASE_SLOT)))
            if start + n == req.num_tokens:
                params = req.sampling_params
                rows.append(SampleRow(
                    req_id=req.request_id,
                    token_index=query_start + n - 1,
                    params=params,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    eos_token_ids=() if params.ignore_eos else req.eos_token_ids,
                    generator_seed=params.seed,
                    grammar=req.grammar,
                ))
        finished, self._finished_ids = self._finished_ids, set()
        return BatchPlan(token_ids, positions, slots, seqs, rows, finished, preempted)

    # ----- update -----------------------------------------------------------------------------------

    def update(self, plan: BatchPlan, output: ModelOutput) -> list[tuple[Request, SampledToken]]:
        """Apply a step's results: advance progress, append sampled tokens, finish what must stop.

        Returns (request, its sampled token) for every request that received one (finished ones too).
        """
        for seq in plan.seqs:
            req = self.requests.get(seq.req_id)
            if req is None:
                continue
            req.num_computed_tokens += seq.query_len
            if seq.query_len > 1:
                self.kv.cache_computed_blocks(req)
        updated = []
        for row, sampled in zip(plan.sample_rows, output.sampled, strict=True):
            req = self.requests.get(row.req_id)
            if req is None:  # finished while the step ran (abort)
                continue
            assert sampled is not None, f"request {row.req_id} got no token (a fault the engine must isolate)"
            req.output_token_ids.append(sampled.token_id)
            if req.grammar is not None:
                req.grammar.accept_token(sampled.token_id)
            updated.append((req, sampled))
            status = self._stop_status(req, sampled.token_id)
            if status is not None:
                self.running.remove(req)
                self._release(req, status)
        return updated

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _release(self, req: Request, status: RequestStatus) -> None:
        """Everything a request holds goes back: blocks (cached first), tree lock, slot pin, grammar."""
        req.status = status
        # NOTE: a request that failed leaves nothing in the prefix cache: its KV may be what went wrong.
        if req.block_ids and status != RequestStatus.FINISHED_ERROR:
            self.kv.cache_computed_blocks(req)
        self.kv.free(req)
        self._lora_slots.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)
        if self.on_release is not None:
            self.on_release(req)

    def check_integrity(self) -> None:
        requests = list(self.requests.values())
        self.kv.check_integrity(requests)
        if self.holdings_check is not None:
            self.holdings_check(requests)
