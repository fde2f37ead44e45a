"""A real engine worker process with a null engine: the worker protocol without a model.

`NullLLM` has the interface `worker.server.WorkerService` drives (generate / abort / stats /
shutdown), declares what it serves in `NULL_CAPABILITIES` (no adapters, no structured output), and
answers every request with exactly `max_tokens` tokens per sample, finish_reason "length", as the engine
does: one `GenerateDelta` per step holding that step's token of each sample (never cumulative),
optionally waiting `token_delay_s` before each token. Served by the real `build_worker_app`, it stands in
for the model when gateway tests and benchmarks measure the gateway itself (quotas, queueing, overhead).

Run it as a process (secret in LORAPLEX_WORKER_SECRET, like `loraplex worker`):
    python -m demo.null_worker --port 8001 [--token-delay-ms 2] [--max-running 1]
`--max-running` makes it refuse work beyond that many concurrent requests (engine_error), so a test can
prove that the gateway never sends more than the worker's capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.llm_engine import EngineStats
from wire.errors import ErrorCode, RequestError
from wire.protocol import GenerateDelta, Logprob, SampleDelta
from wire.sampling import SamplingParams
from worker.capabilities import WorkerCapabilities

NULL_TOKEN_ID = 120  # a byte-level id every test tokenizer has
NULL_TOKEN_TEXT = "x"
NULL_CAPABILITIES = WorkerCapabilities(structured_output=False, adapters=False)


@dataclass(frozen=True)
class NullEngineConfig:
    token_delay_s: float = 0.0  # sleep before each token (0: all tokens as fast as the loop allows)
    max_running: int | None = None  # refuse a request while this many run (None: unbounded)

    def __post_init__(self) -> None:
        if self.token_delay_s < 0:
            raise ValueError(f"token_delay_s must be >= 0, got {self.token_delay_s}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None, got {self.max_running}")


@dataclass
class NullLLM:
    """AsyncLLM's serving interface over no model. Counters are for tests and benchmarks."""

    config: NullEngineConfig = field(default_factory=NullEngineConfig)
    running: set[str] = field(default_factory=set)
    peak_running: int = 0
    started: list[tuple[str, int]] = field(default_factory=list)  # (request id, priority) in start order

    async def generate(self, request_id: str, prompt: dict[str, Any], params: SamplingParams, *,
                       priority: int = 0, adapter: Any = None, cache_salt: str = "") -> AsyncIterator[GenerateDelta]:
        """`params.max_tokens` tokens per sample, one per delta. Raises RequestError(engine_error) when
        over max_running."""
        limit = self.config.max_running
        if limit is not None and len(self.running) >= limit:
            raise RequestError(ErrorCode.ENGINE_ERROR, f"null worker over capacity (max_running={limit})",
                               request_id=request_id)
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        self.running.add(request_id)
        self.peak_running = max(self.peak_running, len(self.running))
        self.started.append((request_id, priority))
        try:
            for step in range(params.max_tokens):
                if self.config.token_delay_s > 0:
                    await asyncio.sleep(self.config.token_delay_s)
                last = step == params.max_tokens - 1
                logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
                samples = [SampleDelta(i, [NULL_TOKEN_ID], NULL_TOKEN_TEXT, logprobs, "length" if last else None)
                           for i in range(params.n)]
                yield GenerateDelta(request_id, samples, num_prompt_tokens, finished=last)
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        return None  # closing the generate iterator already stopped it

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=0, num_kv_blocks=0, num_free_kv_blocks=0,
                           kv_usage=0.0, num_preemptions=0, prefix_query_tokens=0, prefix_hit_tokens=0,
                           prefix_evicted_blocks=0, prefix_cache_blocks=0)

    def shutdown(self) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    from worker.server import run_worker

    parser = argparse.ArgumentParser(prog="null_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-name", default="null-model")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--max-running", type=int, default=None)
    args = parser.parse_args(argv)
    secret = os.environ.get("LORAPLEX_WORKER_SECRET", "")
    if not secret:
        print("null_worker: set LORAPLEX_WORKER_SECRET", file=sys.stderr)
        return 2
    llm = NullLLM(NullEngineConfig(token_delay_s=args.token_delay_ms / 1000, max_running=args.max_running))
    run_worker(llm, args.model_name, secret, NULL_CAPABILITIES, host=args.host,  # type: ignore[arg-type]
               port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
