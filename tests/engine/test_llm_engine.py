"""LLMEngine's lifecycle: `shutdown()` stops the background threads its parts started."""

from __future__ import annotations

import threading
import time

from engine import LLM, SamplingParams

BACKGROUND = ("grammar-", "lora-host-load")  # the grammar compile pool and watchdog, the adapter reader


def test_shutdown_stops_the_threads_of_the_grammar_pool(llama_dir):
    before = set(threading.enumerate())
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=16)
    out = llm.generate("x", SamplingParams(max_tokens=8, choice=["yes", "no"]))[0].outputs[0]
    assert out.text in ("yes", "no")  # compiled on the grammar pool

    def started_here() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and t.name.startswith(BACKGROUND)]

    assert any(t.name.startswith("grammar-watchdog") for t in started_here())
    llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while started_here() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started_here() == []
