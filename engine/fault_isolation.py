"""Per-request fault isolation for one engine step: a step is a transaction over its requests.

`StepIsolator.execute(plan)` runs the runner on a plan. When that raises, the requests to blame are
found by bisection: the scheduled sequences are split in halves and each half runs alone, recursing into
the halves that still fail, until single sequences are left. Those fail (their requests end with
engine_error); every other sequence keeps the token of the one run of it that succeeded. A row whose
logits come back non-finite (the model or its adapter overflowed) fails its request the same way,
without a re-run.

Why a re-run gives the good requests exactly the tokens they would have had:
- nothing of the scheduler changes until `Scheduler.update` (tokens, computed counts, grammar state),
  and update sees only the merged result;
- a sequence writes KV only at its scheduled positions, in blocks that only it holds (the prefix
  cache shares whole computed blocks, never the ones a step writes), so the run that succeeds
  overwrites whatever a failed attempt wrote there;
- every request samples with its own generator (engine.sampler), whose state is put back after each
  failed attempt, so the run that succeeds draws the noise the first attempt drew.

A fault no request can be blamed for raises EngineFault: the batch fails while both of its halves run
(unless it ran out of device memory: then the halves' tokens stand),
every sequence of a batch of two or more fails on its own, or whole steps keep failing. The worker then
exits and its supervisor restarts it; serving on could give silently wrong tokens.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from engine.plan import BatchPlan, ModelOutput, SampledToken, ScheduledSeq
from engine.sampler import Sampler

log = logging.getLogger(__name__)

MAX_LOGGED_CHARS = 4000  # one fault's traceback in the log, cut to this
MAX_FAULT_STREAK = 3  # steps in a row in which every scheduled request failed: then the engine is at fault

NONFINITE_REASON = "the model produced non-finite logits"


class EngineFault(RuntimeError):
    """A step failed and no request can be blamed, or the engine's state is no longer trusted.

    Whoever runs the loop fails every request in flight and restarts the engine (the worker exits).
    """


@dataclass(frozen=True)
class IsolatedStep:
    """What a step ran. `plan` and `output` cover only the sequences that ran (the input plan itself
    when nothing failed); `failed` maps each scheduler request id that must fail to a short reason
    (for the log, never for the tenant)."""

    plan: BatchPlan
    output: ModelOutput
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class IsolationStats:
    faulted_steps: int = 0  # steps whose first run raised
    reruns: int = 0  # partial runs made to find the requests to blame
    failed_requests: int = 0  # requests failed by a fault attributed to them


class StepRunner(Protocol):
    """What the isolator runs plans on (engine.runner.ModelRunner)."""

    sampler: Sampler

    def execute(self, plan: BatchPlan) -> ModelOutput: ...


class StepIsolator:
    """Runs plans on `runner`, blaming faults on the requests that cause them.

    The runner's sampler has its per-request generator state snapshotted before each run and restored
    after a failed one. Holds no request state; touched only by the engine's thread.
    """

    def __init__(self, runner: StepRunner) -> None:
        self._runner = runner
        self._streak = 0  # consecutive steps in which every scheduled request failed
        self.stats = IsolationStats()

    def execute(self, plan: BatchPlan) -> IsolatedStep:
        """Run `plan`; see the module docstring. Raises EngineFault for a fault it cannot attribute."""
        output, error = self._attempt(plan)
        if error is not None:
            self.stats.faulted_steps += 1
            _log_fault(error, [s.req_id for s in plan.seqs])
            results: dict[str, SampledToken | None] = {}
            failed: dict[str, str] = {}
            self._bisect(plan, list(plan.seqs), results, failed, out_of_memory=isinstance(error, torch.OutOfMemoryError))
        else:
            assert output is not None
            results = {row.req_id: tok for row, tok in zip(plan.sample_rows, output.sampled, strict=True)}
            failed = {}
        failed.update({rid: NONFINITE_REASON for rid, tok in results.items() if tok is None})
        if not failed:
            if plan.seqs:
                self._streak = 0
            return IsolatedStep(plan, output) if output is not None else self._merge(plan, results, failed)
        if len(failed) == len(plan.seqs):
            self._streak += 1
            if len(plan.seqs) > 1 or self._streak >= MAX_FAULT_STREAK:
                raise EngineFault(f"every one of the {len(plan.seqs)} scheduled sequences failed "
                                  f"({self._streak} such step(s) in a row): the engine, not a request, is at fault")
        else:
            self._streak = 0
        self.stats.failed_requests += len(failed)
        log.warning("step fault attributed to request(s) %s", ", ".join(sorted(failed))[:MAX_LOGGED_CHARS])
        return self._merge(plan, results, failed)

    # ----- internals --------------------------------------------------------------------------------

    def _attempt(self, plan: BatchPlan) -> tuple[ModelOutput | None, BaseException | None]:
        sampler = self._runner.sampler
        snap = sampler.snapshot([row.req_id for row in plan.sample_rows if not row.params.greedy])
        try:
            output = self._runner.execute(plan)
        except Exception as e:  # noqa: BLE001 -- any fault is attributed (or escalated) by the caller
            sampler.restore(snap)
            return None, e
        if len(output.sampled) != len(plan.sample_rows):
            sampler.restore(snap)
            return None, AssertionError(f"the runner returned {len(output.sampled)} tokens for "
                                        f"{len(plan.sample_rows)} rows")
        return output, None

    def _bisect(self, plan: BatchPlan, group: list[ScheduledSeq], results: dict[str, SampledToken | None],
                failed: dict[str, str], *, out_of_memory: bool) -> None:
        """`group` failed when run together: find its members that fail alone. Records the tokens of
        every member that ran in `results` and the culprits in `failed`. `out_of_memory`: the batch ran
        out of device memory, which its halves may not (no state is wrong then: their tokens stand)."""
        if len(group) == 1:
            failed[group[0].req_id] = "the step failed while running this request"
            return
        mid = len(group) // 2
        halves = (group[:mid], group[mid:])
        still_failing = []
        for half in halves:
            sub = sub_plan(plan, half)
            self.stats.reruns += 1
            output, _ = self._attempt(sub)
            if output is None:
                still_failing.append(half)
                continue
            results.update({row.req_id: tok for row, tok in zip(sub.sample_rows, output.sampled, strict=True)})
        if not still_failing:
            if out_of_memory:
                log.warning("a batch of %d sequences ran out of device memory; it ran in halves", len(group))
                return
            raise EngineFault(f"a batch of {len(group)} sequences failed, but each of its halves ran: "
                              "the fault cannot be attributed to a request")
        for half in still_failing:
            self._bisect(plan, half, results, failed, out_of_memory=out_of_memory)

    @staticmethod
    def _merge(plan: BatchPlan, results: dict[str, SampledToken | None], failed: dict[str, str]) -> IsolatedStep:
        good = [s for s in plan.seqs if s.req_id not in failed]
        kept = replace(sub_plan(plan, good), finished_req_ids=plan.finished_req_ids,
                       num_preempted=plan.num_preempted)
        sampled = [results[row.req_id] for row in kept.sample_rows]
        assert all(tok is not None for tok in sampled)
        return IsolatedStep(kept, ModelOutput(sampled), dict(failed))  # type: ignore[arg-type]


def sub_plan(plan: BatchPlan, seqs: list[ScheduledSeq]) -> BatchPlan:
    """The part of `plan` that runs `seqs` (a subsequence of plan.seqs, in its order): their tokens,
    positions and KV slots at the same places in KV, rows re-indexed. Frees nothing (no finished ids)."""
    token_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    new_seqs: list[ScheduledSeq] = []
    shift: dict[str, int] = {}  # request id -> how far its tokens moved
    for seq in seqs:
        lo, hi = seq.query_start, seq.query_start + seq.query_len
        shift[seq.req_id] = len(token_ids) - lo
        new_seqs.append(replace(seq, query_start=len(token_ids)))
        token_ids.extend(plan.token_ids[lo:hi])
        positions.extend(plan.positions[lo:hi])
        slot_mapping.extend(plan.slot_mapping[lo:hi])
    rows = [replace(row, token_index=row.token_index + shift[row.req_id])
            for row in plan.sample_rows if row.req_id in shift]
    return BatchPlan(token_ids, positions, slot_mapping, new_seqs, rows)


def _log_fault(error: BaseException, req_ids: list[str]) -> None:
    """The fault's traceback, once per faulted step and bounded in size (tenants never see it)."""
    text = "".join(traceback.format_exception(error))
    if len(text) > MAX_LOGGED_CHARS:
        text = text[: MAX_LOGGED_CHARS // 4] + "\n  ...\n" + text[-3 * MAX_LOGGED_CHARS // 4 :]
    log.error("engine step over %d sequence(s) raised; isolating the request(s) at fault:\n%s",
              len(req_ids), text)
