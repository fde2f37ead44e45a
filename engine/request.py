"""Request state as the scheduler sees it: token ids, progress, blocks held. No tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wire.sampling import SamplingParams

if TYPE_CHECKING:
    from grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(frozen=True)
class AdapterRef:
    """Which LoRA adapter a request runs with: its name and content hash (its identity)."""

    name: str
    sha256: str


@dataclass
class Request:
    """One sequence being generated. Mutated only by the scheduler.

    Tokens are computed uniformly: `all_token_ids[num_computed_tokens:]` still need a forward pass,
    whether they are prompt tokens, the last sampled token, or tokens to recompute after preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    adapter: AdapterRef | None = None
    cache_salt: str = ""  # chosen by the server per tenant; part of the prefix-cache namespace
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    grammar: GrammarMatcher | None = None  # a grammar matcher once compiled (grammar package)
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, float, str]:
        """Scheduling order: lower priority number first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without materialising the whole sequence (hot path: decode)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
