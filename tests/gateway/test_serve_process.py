"""`loraplex serve` as real processes: demo model and tenant, worker killed mid-stream, restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


class ServeProcess:
    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_PORT": str(self.port)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--kv-cache-memory-gb", "0.05"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "\n".join(self.lines[-30:])
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("gateway never became healthy:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture()
def served(tmp_path):
    server = ServeProcess(tmp_path)
    yield server, tmp_path
    server.stop()


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
            assert e.status_code == 503 and e.body["code"] == "service_unavailable"
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.3)
    assert again.choices[0].finish_reason in ("stop", "length")
    assert int((data_dir / "worker.pid").read_text()) != worker_pid
