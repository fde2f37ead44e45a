"""The gateway process never loads torch: `loraplex serve` with no model (demo model, demo tenant) in a
fresh interpreter, serving a chat completion through a null worker process, imports none of torch,
triton, the grammar backends, engine/, grammar/, kernels/, worker/ or demo/."""

from __future__ import annotations

import json
import signal
import sys

import httpx
import pytest

from tests.conftest import free_port
from tests.gateway.quota_stack import SECRET, Process, start_null_worker, wait_http, wait_null_worker

pytestmark = pytest.mark.slow

HEAVY = ("torch", "triton", "llguidance", "outlines_core", "engine", "grammar", "kernels", "worker", "demo")
# `loraplex` itself, then (once it stopped) which of HEAVY this interpreter imported and its peak RSS.
GATEWAY = f"""
import json, sys
from gateway.cli.main import main
code = main(sys.argv[1:])
loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("GATEWAY-EXIT " + json.dumps({{"loaded": loaded, "peak_rss_kib": peak_kib}}), flush=True)
sys.exit(code)
"""


def test_the_gateway_serves_a_chat_completion_without_loading_torch(tmp_path):
    worker, worker_url = start_null_worker()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = Process([sys.executable, "-c", GATEWAY, "serve", "--worker-url", worker_url, "--port", str(port),
                       "--data-dir", str(tmp_path)], env={"LORAPLEX_WORKER_SECRET": SECRET})
    try:
        wait_null_worker(worker, worker_url)
        wait_http(url + "/health", gateway, timeout_s=120)  # after the demo model was built
        key = next(line for line in gateway.lines if line.startswith("lpx-"))
        answer = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                            json={"model": "loraplex-demo", "max_tokens": 3,
                                  "messages": [{"role": "user", "content": "hello"}]})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["message"]["content"] == "xxx"  # the null worker's three tokens
        assert body["usage"]["completion_tokens"] == 3
    finally:
        gateway.stop(signal.SIGINT)
        worker.stop()
    exit_line = next((line for line in gateway.lines if line.startswith("GATEWAY-EXIT ")), None)
    assert exit_line is not None, gateway.tail()
    report = json.loads(exit_line.removeprefix("GATEWAY-EXIT "))
    assert report["loaded"] == [], report
    assert (tmp_path / "demo-model" / "model.safetensors").is_file()  # built by a child process
