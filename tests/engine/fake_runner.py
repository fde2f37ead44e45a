"""A tensor-free stand-in for ModelRunner used by scheduler tests: deterministic 'sampling'."""

from __future__ import annotations

from engine.plan import BatchPlan, ModelOutput, SampledToken


class FakeRunner:
    """Samples token (sum of the row's known tokens + its length) % vocab: same history, same token."""

    def __init__(self, vocab: int = 97) -> None:
        self.vocab = vocab
        self.executed: list[BatchPlan] = []

    def execute(self, plan: BatchPlan) -> ModelOutput:
        self.executed.append(plan)
        out = []
        for row in plan.sample_rows:
            history = row.prompt_token_ids + row.output_token_ids
            out.append(SampledToken((sum(history) * 31 + len(history)) % self.vocab))
        return ModelOutput(out)
