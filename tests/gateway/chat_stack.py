"""A gateway over an in-process engine for one checkpoint, as `loraplex serve` builds it, for chat tests.

`ChatStack.start(model_dir, data_dir)` serves the model on a free port with one roomy tenant; the gateway's
tokenizer (its chat template) may differ from the engine's (`chat_template=` is `--chat-template`), and
several stacks may share one engine (`llm=`): only the gateway renders templates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import openai

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from gateway.app import build_app
from gateway.state import GatewayConfig
from gateway.store import SqliteStore
from gateway.workers.client import InProcessEngineClient
from tests.gateway.conftest import ROOMY_POLICY, ThreadedServer, serve_admission
from tokenization.tokenizer import Tokenizer
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService

MODEL = "tiny"


@dataclass
class ChatStack:
    server: ThreadedServer
    store: SqliteStore
    llm: AsyncLLM
    owns_llm: bool
    key: str

    @classmethod
    def start(cls, model_dir: Path, data_dir: Path, *, llm: AsyncLLM | None = None,
              chat_template: Path | None = None, tool_call_parser: str | None = None) -> ChatStack:
        data_dir.mkdir(parents=True, exist_ok=True)
        owns = llm is None
        if llm is None:
            llm = AsyncLLM.from_config(EngineConfig(model=str(model_dir), num_kv_blocks=512, block_size=16,
                                                    max_num_seqs=32))
        store = SqliteStore(data_dir / "store.db")
        client = InProcessEngineClient(WorkerService(llm, MODEL, WorkerCapabilities.of_engine(llm.engine.config)))
        config = GatewayConfig(served_model_name=MODEL, adapter_root=data_dir / "adapters",
                               tool_call_parser=tool_call_parser)
        app = build_app(config, store, client, Tokenizer(model_dir, chat_template=chat_template),
                        admission=serve_admission(32, data_dir))
        tenant = store.create_tenant("t", policy=ROOMY_POLICY)
        key, _ = store.create_api_key(tenant.id)
        return cls(ThreadedServer(app).start(), store, llm, owns, key)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key=self.key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.stop()
        if self.owns_llm:
            self.llm.shutdown()
        self.store.close()
