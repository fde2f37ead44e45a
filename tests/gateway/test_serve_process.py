"""`loraplex serve` as real processes: demo model and tenant, worker killed mid-stream, restart."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.gateway.quota_stack import Process

pytestmark = pytest.mark.slow


class ServeProcess(Process):
    """`python -m gateway.cli.main serve` with no model (demo model and tenant) on a free port."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        super().__init__([sys.executable, "-m", "gateway.cli.main", "serve", "--kv-cache-memory-gb", "0.05"],
                         env={"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_PORT": str(self.port)})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("gateway never became healthy:\n" + self.tail())


@pytest.fixture()
def served(tmp_path):
    server = ServeProcess(tmp_path)
    yield server, tmp_path
    server.stop(signal.SIGINT)


def test_worker_killed_mid_stream_ends_the_stream_with_an_error_and_is_restarted(served):
    server, data_dir = served
    server.wait_healthy(timeout_s=120)
    key = next(line for line in server.lines if line.startswith("lpx-"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    assert client.models.list().data[0].id == "loraplex-demo"
    ok = client.chat.completions.create(model="loraplex-demo", max_tokens=3,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.role == "assistant"

    worker_pid = int((data_dir / "worker.pid").read_text())
    stream = client.chat.completions.create(model="loraplex-demo", max_tokens=2000, stream=True,
                                            messages=[{"role": "user", "content": "go on"}],
                                            extra_body={"ignore_eos": True})
    received = 0
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="engine worker"):
        for _chunk in stream:
            received += 1
            if received == 2:
                os.kill(worker_pid, signal.SIGKILL)
    assert received >= 2 and time.monotonic() - started < 30

    # Meanwhile requests get a clean 503 or succeed once the new worker is up; never a hang.
    deadline = time.monotonic() + 90
    while True:
        try:
            again = client.chat.completions.create(model="loraplex-demo", max_tokens=3,
                                                   messages=[{"role": "user", "content": "hi"}])
            break
        except openai.APIStatusError as e:
            # worker_unavailable: the worker's port refuses (wire/errors.py); service_unavailable: admission's
            assert e.status_code == 503 and e.body["code"] in ("worker_unavailable", "service_unavailable")
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.3)
    assert again.choices[0].finish_reason in ("stop", "length")
    assert int((data_dir / "worker.pid").read_text()) != worker_pid
