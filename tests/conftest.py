"""Shared fixtures: tiny random checkpoints and trained tokenizers, made once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# NOTE: Triton decides between interpreted and compiled kernels when a kernel module is imported, so
# without a GPU the interpreter is switched on here, before anything imports kernels.*_triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from demo.checkpoint import FAMILIES, TinyModelSpec, make_checkpoint, train_tokenizer  # noqa: E402

# The references the engine is checked against (transformers, peft, fp32 math) are float32; on a CPU with
# native bf16 dtype="auto" would pick bfloat16, so the suite pins the CPU default for itself and every
# worker process it starts. tests/kernels/test_cpu_features.py checks the unpinned rule.
os.environ.setdefault("LORAPLEX_CPU_DTYPE", "float32")

# Tiny models gain nothing from intra-op threads, and the suite runs one process per core.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both tokenizer kinds, trained once: {"byte_bpe": dir, "sentencepiece": dir}."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: train_tokenizer(root / kind, kind) for kind in ("byte_bpe", "sentencepiece")}


@pytest.fixture(scope="session")
def styled_tokenizer_dirs(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                          ) -> dict[tuple[str, str], Path]:
    """{(tokenizer kind, chat style): tokenizer dir} for both kinds and every style of demo/chat_styles.py
    (the trained tokenizers plus the style's markup tokens, template, BOS and EOS)."""
    from demo.chat_styles import CHAT_STYLES, with_chat_style

    root = tmp_path_factory.mktemp("styled-tokenizers")
    return {(kind, style): with_chat_style(src, root / f"{kind}-{style}", style)
            for kind, src in tokenizer_dirs.items() for style in CHAT_STYLES}


@pytest.fixture(scope="session")
def make_model(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dirs: dict[str, Path]
) -> Callable[..., Path]:
    """Factory: make_model(family="llama", tokenizer="byte_bpe", shards=1, **spec_overrides) -> dir.

    Checkpoints are cached per argument set for the whole session.
    """
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", tokenizer: str = "byte_bpe", shards: int = 1, seed: int = 0,
             dtype: torch.dtype = torch.float32, **overrides) -> Path:
        key = (family, tokenizer, shards, seed, dtype, repr(sorted(overrides.items())))
        if key not in cache:
            spec: TinyModelSpec = FAMILIES[family]
            if overrides:
                spec = TinyModelSpec(**{**spec.__dict__, **overrides})
            out = tmp_path_factory.mktemp(f"{family}-{tokenizer}")
            cache[key] = make_checkpoint(
                out, spec, tokenizer_dir=tokenizer_dirs[tokenizer], shards=shards, seed=seed, dtype=dtype
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(make_model: Callable[..., Path]) -> Path:
    return make_model("llama")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def redis_server(tmp_path: Path):
    """A real redis-server on a free loopback port, started for one test: yields its URL.

    The handle's `.process` lets a test stop the server mid-test (fail-open/closed tests).
    """
    import shutil
    import subprocess


    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh (installs Debian's redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    wait_for_redis(url)
    server = RedisServer(url=url, process=proc)
    yield server
    proc.terminate()
    proc.wait(timeout=10)


def wait_for_redis(url: str, timeout_s: float = 5.0) -> None:
    """Block until a redis-server answers PING at url (or the timeout passes)."""
    import time

    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
    finally:
        client.close()


class RedisServer:
    def __init__(self, url: str, process) -> None:
        self.url = url
        self.process = process

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
