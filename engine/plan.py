"""The typed boundary between the scheduler (plain Python) and the runner (tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wire.sampling import SamplingParams

if TYPE_CHECKING:
    from grammar import GrammarMatcher


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    req_id: str
    query_start: int  # offset of this sequence's first token in BatchPlan.token_ids
    query_len: int  # tokens computed for it this step (a prefill chunk, or 1 for decode)
    seq_len: int  # tokens in KV after this step (cached context + query_len)
    block_table: list[int]  # KV block ids covering positions 0 .. seq_len - 1
    lora_slot: int  # device adapter slot, -1 for the base model


@dataclass(frozen=True)
class SampleRow:
    """A sequence whose last scheduled token produces logits to sample from."""

    req_id: str
    token_index: int  # index into BatchPlan.token_ids of the token whose logits are sampled
    params: SamplingParams
    prompt_token_ids: list[int]  # for the repetition penalty
    output_token_ids: list[int]  # for presence/frequency penalties and min_tokens
    eos_token_ids: tuple[int, ...]  # suppressed while len(output) < min_tokens
    generator_seed: int | None  # per-request seed; the runner keeps one generator per request
    grammar: GrammarMatcher | None = None  # grammar matcher whose bitmask constrains this row


@dataclass(frozen=True)
class BatchPlan:
    """Everything the runner needs for one forward pass. Built by Scheduler.schedule()."""

    token_ids: list[int]  # (T,) flat token ids of all scheduled sequences, in `seqs` order
    positions: list[int]  # (T,) absolute position of each token
    slot_mapping: list[int]  # (T,) KV slot = block_id * block_size + offset for each token
    seqs: list[ScheduledSeq]  # in batch order: grouped by lora_slot so LoRA runs over segments
    sample_rows: list[SampleRow]  # sequences that sample a token this step, in `seqs` order
    finished_req_ids: set[str] = field(default_factory=set)  # freed since the last plan
    num_preempted: int = 0  # sequences preempted while building this plan

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # log-probability of the sampled token (raw model distribution)
    top_logprobs: list[tuple[int, float]] | None = None  # the N most likely (token, logprob)


@dataclass(frozen=True)
class ModelOutput:
    """What the runner returns: one sampled token per SampleRow, in the same order.

    None where the row's logits were not finite: no token, and its request must fail (the engine's
    StepIsolator does that; Scheduler.update never sees a None)."""

    sampled: list[SampledToken | None]
