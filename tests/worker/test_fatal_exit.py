"""A fault no request can be blamed for: every stream in flight ends with engine_error, then the worker
process exits so that its supervisor starts a fresh one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from wire.protocol import WORKER_SECRET_HEADER, GenerateRequest
from wire.sampling import SamplingParams
from worker.server import FATAL_EXIT_CODE

SECRET = "s3cret"
ROOT = Path(__file__).resolve().parents[2]

# The worker as worker.cli runs it (the engine loop in a child process, on_fatal=exit_on_engine_fault), with a
# fault injected there around the real forward that only a batch of two or more sequences hits.
WORKER = """
import asyncio
import sys

from engine.config import EngineConfig
from engine.core_process import ProcessAsyncLLM
from tests.engine.faults import break_batches_of_two
from worker.capabilities import WorkerCapabilities
from worker.server import FATAL_EXIT_CODE, exit_on_engine_fault, run_worker


async def install_fault(llm):
    await llm.call_in_loop(break_batches_of_two)


if __name__ == "__main__":  # NOTE: the engine process imports this file again (multiprocessing's spawn)
    config = EngineConfig(model=sys.argv[1], num_kv_blocks=64, block_size=4)
    llm = ProcessAsyncLLM(config, on_fatal=exit_on_engine_fault)
    asyncio.run(install_fault(llm))
    run_worker(llm, "tiny", sys.argv[3], WorkerCapabilities.of_engine(config), port=int(sys.argv[2]))
    sys.exit(FATAL_EXIT_CODE if llm.fatal_error is not None else 0)
"""


@pytest.mark.slow
def test_an_unattributable_fault_ends_every_stream_then_the_worker_exits(llama_dir, tmp_path):
    port = free_port()
    script = tmp_path / "faulty_worker.py"  # NOTE: not worker.py, which would shadow the worker package
    script.write_text(WORKER)
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([sys.executable, str(script), str(llama_dir), str(port), SECRET],
                                stdout=subprocess.DEVNULL, stderr=log_file,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})  # the script imports tests.engine
    url = f"http://127.0.0.1:{port}"
    headers = {WORKER_SECRET_HEADER: SECRET}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-2000:]
            try:
                if httpx.get(url + "/health", headers=headers, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        last_lines: dict[str, dict] = {}
        a_streams = threading.Event()

        def generate(rid: str) -> None:
            request = GenerateRequest(rid, [5, 6, 7, 8], SamplingParams(max_tokens=400, temperature=0.0,
                                                                         ignore_eos=True))
            lines = []
            with httpx.stream("POST", url + "/generate", headers=headers, json=request.to_json(), timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(json.loads(line))
                        a_streams.set()
            last_lines[rid] = lines[-1]

        # b starts once a is decoding (a has hundreds of tokens to go), so the two meet in one batch
        # whatever the speed of a step: the fault needs a batch of two
        threads = [threading.Thread(target=generate, args=(rid,)) for rid in ("a", "b")]
        threads[0].start()
        assert a_streams.wait(60)
        threads[1].start()
        for t in threads:
            t.join(90)
        for rid in ("a", "b"):
            assert last_lines[rid]["type"] == "error" and last_lines[rid]["code"] == "engine_error", last_lines
            assert "Injected" not in last_lines[rid]["message"]
        # uvicorn ends a graceful shutdown with the signal that started it; a hung one exits FATAL_EXIT_CODE
        assert proc.wait(timeout=60) in (-signal.SIGTERM, FATAL_EXIT_CODE)
        assert "the worker exits" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
