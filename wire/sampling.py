"""Per-request sampling parameters (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction; ValueError names the field.

    Structured output: at most one of json_schema (a dict or JSON string; `{"type": "object"}` with no
    other keys plus `json_object=True` means any JSON object), regex, choice. A constrained request ends
    with "stop" when its grammar is complete, or "length" if max_tokens comes first.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0 = only the sampled token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    json_schema: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
            (self.choice is None or len(self.choice) > 0, "choice", "must list at least one option"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        constraints = [self.json_schema is not None or self.json_object, self.regex is not None,
                       self.choice is not None]
        if sum(constraints) > 1:
            raise ValueError("at most one of json_schema/json_object, regex and choice may be set")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_grammar(self) -> bool:
        return self.json_schema is not None or self.json_object or self.regex is not None or self.choice is not None

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
