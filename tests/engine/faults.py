"""Faults the engine tests inject. Module-level functions of the engine: they pickle by name, so
`call_in_loop` can run them where the engine loop runs, a child process included."""

from __future__ import annotations


def break_batches_of_two(engine) -> None:
    """A fault only a batch of two or more sequences hits, around the real forward: each half runs, so
    nobody can be blamed."""
    runner = engine.runner
    execute, forward, seen = runner.execute, runner.model.forward, {"n": 0}

    def recording_execute(plan):
        seen["n"] = len(plan.seqs)
        return execute(plan)

    def faulty_forward(*args, **kwargs):
        if seen["n"] >= 2:
            raise RuntimeError("Injected fault")
        return forward(*args, **kwargs)

    runner.execute, runner.model.forward = recording_execute, faulty_forward
