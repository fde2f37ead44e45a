"""The gateway's configuration and the shared objects its handlers reach through lifespan state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.adapters.resolver import ModelResolver
from gateway.admission.base import RequestAdmission, UsageReporter
from gateway.http.json_body import DEFAULT_MAX_SCHEMA_DEPTH
from gateway.http.prompt_pool import PromptPool
from gateway.store import Store
from gateway.workers.client import EngineClient
from tokenization.tokenizer import Tokenizer
from tokenization.tool_formats import ToolCalling, tool_format

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    served_model_name: str
    adapter_root: Path  # content-addressed adapter storage shared with the workers
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = 256  # chat requests without max_tokens / max_completion_tokens
    default_completion_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    tool_call_parser: str | None = None  # the operator's --tool-call-parser (default: the template's format)
    prompt_threads: int = 4  # threads that render chat templates and tokenize (gateway/http/prompt_pool.py)
    max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH  # response_format / tool parameter schemas, deeper: 400
    upload_read_timeout_s: float = 30.0  # an upload that sends nothing for this long is dropped (408)
    max_concurrent_uploads: int = 2  # adapter uploads one tenant may stream at once (more: 429), per gateway

    def __post_init__(self) -> None:
        if not self.served_model_name or "@" in self.served_model_name:
            raise ValueError(f"served_model_name must be non-empty and contain no '@', got {self.served_model_name!r}")
        if self.tool_call_parser is not None:
            tool_format(self.tool_call_parser)  # ValueError naming the known ones
        if self.upload_read_timeout_s <= 0:
            raise ValueError(f"upload_read_timeout_s must be > 0, got {self.upload_read_timeout_s}")
        for name in ("max_body_bytes", "default_max_tokens", "default_completion_max_tokens", "prompt_threads",
                     "max_schema_depth", "max_concurrent_uploads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class GatewayState:
    config: GatewayConfig
    store: Store
    engine: EngineClient
    tokenizer: Tokenizer
    resolver: ModelResolver
    admission: RequestAdmission
    usage: UsageReporter
    tool_calling: ToolCalling  # the served model's tool call format (tokenization/tool_formats.py)
    prompts: PromptPool  # renders and tokenizes off the event loop, bounded

    @property
    def adapter_root(self) -> Path:
        return self.config.adapter_root

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
