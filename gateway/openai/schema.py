"""Request bodies of the OpenAI API as pydantic models.

Like OpenAI: unknown fields are ignored, wrong types are 400 invalid_request_error naming the param
(strict types: "5" is not an int). These models check JSON types and shapes only (which fields, lists
of what, how many stop sequences); the values of sampling fields are bounded once, by
wire.sampling.SamplingParams, when gateway/openai/prompt.py builds it. Engine limits (context length,
vocabulary) are checked by the engine; all of these come back as 400s naming the param.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.http.errors import ApiError, invalid_request
from gateway.http.json_body import load_json_body
from wire.sampling import MAX_STOP_TOKEN_IDS

MAX_STOP_SEQUENCES = 4


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(_Body):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    def template_fields(self) -> dict[str, Any]:
        """The message as gateway/openai/tools/messages.py reads it (fields that are set)."""
        return self.model_dump(exclude_none=True) | {"content": self.model_dump()["content"]}

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Body):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ServiceTier = Literal["auto", "default", "flex", "priority"]


class _SamplingFields(_Body):
    """Fields chat and completions share (OpenAI names, plus vLLM's extras)."""

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-compatible extras
    priority: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    service_tier: ServiceTier | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    prompt_cache_key: str | None = None  # a caching hint: loraplex's prefix cache needs none
    safety_identifier: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: variables for the chat template
    # OpenAI parameters loraplex does not serve: a request that sets one is refused, naming it
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes → validated request model, or an ApiError(400) naming the offending param."""
    data = load_json_body(raw)  # 400 for bad JSON, too deep, lone surrogates (gateway/http/json_body.py)
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> ApiError:
    first = e.errors(include_url=False)[0]
    param = _param_name(first["loc"])
    if first["type"] == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param=param,
                               code="missing_required_parameter")
    message = first["msg"]
    if first["type"] in ("int_type", "float_type", "string_type", "bool_type", "list_type", "dict_type",
                         "model_type", "literal_error", "union_tag_invalid"):
        return invalid_request(f"Invalid type for '{param}': {message}.", param=param, code="invalid_type")
    return invalid_request(f"Invalid value for '{param}': {message}.", param=param, code="invalid_value")


def _param_name(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content', 'str') → 'messages[0].content' (union member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or "body"


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "NamedToolChoice"})
