"""The gateway's configuration and the shared objects its handlers reach through lifespan state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.adapters.resolver import ModelResolver
from gateway.admission.base import RequestAdmission, UsageReporter
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

    def __post_init__(self) -> None:
        if not self.served_model_name or "@" in self.served_model_name:
            raise ValueError(f"served_model_name must be non-empty and contain no '@', got {self.served_model_name!r}")
        if self.tool_call_parser is not None:
            tool_format(self.tool_call_parser)  # ValueError naming the known ones
        for name in ("max_body_bytes", "default_max_tokens", "default_completion_max_tokens"):
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

    @property
    def adapter_root(self) -> Path:
        return self.config.adapter_root

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
