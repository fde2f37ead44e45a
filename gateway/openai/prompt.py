"""Validated OpenAI bodies → prompt token ids and the request's `SamplingParams`.

Two steps, admission between them: `chat_inputs` / `completion_inputs` check a body cheaply and give an
estimate of its prompt tokens (what admission charges before any expensive work); `chat_prompt_ids` /
`completion_prompt_ids` then render and tokenize, blocking, in the prompt pool (gateway/http/prompt_pool.py).
Chat messages and tools go through the model's chat template (tokenization/chat_template.py), with
the strings the request supplies tokenized as text (only the template's markup becomes control tokens);
the rendered text already holds BOS, so nothing is added. The sampling
spec is built here, once, and travels as it is to the sampler: its bounds are SamplingParams' own, and a
value out of them is a 400 naming the body's param.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.http.errors import ApiError, invalid_request
from gateway.http.json_body import DEFAULT_MAX_SCHEMA_DEPTH, too_deep, value_depth
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, NamedToolChoice, ResponseFormat
from gateway.openai.tools.messages import template_messages
from gateway.openai.tools.plan import ToolPlan, plan_tools
from tokenization.chat_template import RESERVED_VARIABLES
from tokenization.tokenizer import ChatTemplateError, Tokenizer
from tokenization.tool_formats import ToolCalling
from wire.sampling import ConstrainedTool, InvalidSamplingParams, SamplingParams, ToolCallConstraint


@dataclass(frozen=True)
class ChatInputs:
    """A chat request in its template's terms, checked (cheap: no rendering, no tokens yet). Rendering
    and tokenizing it is `chat_prompt_ids`, which the routes run in the prompt pool after admission."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    tools: ToolPlan | None  # the request's tools as checked once (None without tools)

    def estimated_tokens(self) -> int:
        """A cheap estimate of the prompt's tokens for admission (OpenAI's rule: ~4 characters a token),
        the content of every message and tool; the exact count replaces it once tokenized."""
        chars = sum(len(m["content"]) for m in self.messages if isinstance(m.get("content"), str))
        if self.template_tools:
            chars += sum(len(str(t)) for t in self.template_tools)
        return estimate_tokens(chars) + 4 * len(self.messages)  # + a few markup tokens per turn


def estimate_tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN_ESTIMATE)


CHARS_PER_TOKEN_ESTIMATE = 4


def chat_inputs(calling: ToolCalling, body: ChatCompletionRequest,
                max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH) -> ChatInputs:
    """The conversation and its tools as the template reads them. Raises ApiError(400) naming the param:
    a tool or tool_choice (gateway/openai/tools/plan.py), a tool schema nested too deeply, a message field,
    chat_template_kwargs."""
    tools = None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools]
    for i, tool in enumerate(body.tools or ()):
        if tool.function.parameters is not None and value_depth(tool.function.parameters) > max_schema_depth:
            raise too_deep(max_schema_depth, f"tools[{i}].function.parameters")
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    plan = plan_tools(tools, choice, body.parallel_tool_calls)
    kwargs = body.chat_template_kwargs or {}
    reserved = sorted(RESERVED_VARIABLES & kwargs.keys())
    if reserved:
        raise invalid_request(f"chat_template_kwargs may not set {reserved[0]!r}.", param="chat_template_kwargs",
                              code="invalid_value")
    messages, template_tools = template_messages([m.template_fields() for m in body.messages], calling, plan)
    return ChatInputs(messages, template_tools, dict(kwargs), plan)


def chat_prompt_ids(tokenizer: Tokenizer, inputs: ChatInputs) -> list[int]:
    """Render and tokenize the conversation (blocking, CPU-bound: run it in the prompt pool). Raises
    ApiError(400) naming `messages` for the template's own refusal (its message, e.g. a
    `raise_exception` text). Its strings are valid Unicode: the body's and the tool call arguments' JSON
    were checked (gateway/http/json_body.py)."""
    try:
        return tokenizer.encode_chat(inputs.messages, tools=inputs.template_tools,
                                     template_kwargs=inputs.template_kwargs)
    except ChatTemplateError as e:
        raise invalid_request(str(e), param="messages") from None


def tool_constraint(calling: ToolCalling, plan: ToolPlan | None) -> ToolCallConstraint | None:
    """The grammar's share of the plan: which tools a call may name, in the served model's format."""
    if plan is None or not plan.constrains:
        return None
    tools = tuple(ConstrainedTool(plan.tools.index(t), t.name, t.parameters) for t in plan.allowed)
    return ToolCallConstraint(calling.format.name, tools, plan.mode, plan.parallel)


MAX_PROMPTS = 64  # prompts in one completions request


def completion_inputs(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: each a string or a list of token ids, checked (cheap: no
    tokens yet). Raises ApiError(400) naming `prompt`."""
    prompt: Any = body.prompt
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise invalid_request(f"At most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompts)}.",
                              param="prompt")
    for p in prompts:
        if not p:
            raise invalid_request("The prompt must not be empty.", param="prompt")
    return prompts


def estimated_completion_tokens(prompts: list[str | list[int]]) -> int:
    """Admission's estimate: exact for token ids, ~4 characters a token for text."""
    return sum(len(p) if isinstance(p, list) else estimate_tokens(len(p)) + 1 for p in prompts)


def completion_prompt_ids(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    """The token ids of each prompt (blocking, CPU-bound for text: run it in the prompt pool). Raises
    ApiError(400) naming `prompt`."""
    return [_prompt_ids(tokenizer, p) for p in prompts]


def _prompt_ids(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if any(t < 0 or t >= tokenizer.vocab_size for t in prompt):
        raise invalid_request(f"Prompt token ids must be in [0, {tokenizer.vocab_size}).", param="prompt")
    return list(prompt)


def sampling_params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                    logprobs: int | None, *, vocab_size: int, tools: ToolCallConstraint | None = None,
                    max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH) -> SamplingParams:
    """The request's SamplingParams. Raises ApiError(400) naming the body's param for a value that
    SamplingParams refuses (`max_tokens` and `logprobs` are what the caller read from the body).

    A request with tool calls decodes with special tokens kept: its format's markers may be special
    tokens (gateway/openai/tools/reader.py reads them and cuts the final one)."""
    fields: dict[str, Any] = {"n": body.n, "max_tokens": max_tokens, "ignore_eos": body.ignore_eos}
    if tools is not None:
        fields.update(tool_calls=tools, skip_special_tokens=False)
    if body.logit_bias:
        fields["logit_bias"] = _logit_bias(body.logit_bias, vocab_size)
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0.0:  # OpenAI accepts 0: only the most likely token
        temperature, top_p = 0.0, 1.0
    fields.update(temperature=temperature, top_p=top_p)
    optional = {
        "seed": body.seed, "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "top_k": body.top_k, "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
        "logprobs": logprobs, "min_tokens": body.min_tokens, "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    fields.update(structured_output_fields(body.response_format, max_schema_depth))
    try:
        return SamplingParams(**fields)
    except InvalidSamplingParams as e:
        raise _invalid_param(body, e) from None


def _invalid_param(body: ChatCompletionRequest | CompletionRequest, e: InvalidSamplingParams) -> ApiError:
    """A SamplingParams refusal, named by the body's param that carried the value."""
    param = e.param
    if param == "max_tokens" and isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        param = "max_completion_tokens"
    elif param == "logprobs" and isinstance(body, ChatCompletionRequest):
        param = "top_logprobs"
    elif param in ("json_schema", "json_object", "regex", "choice"):
        param = "response_format"
    elif param == "tool_calls":
        param = "tools"
    return invalid_request(f"Invalid value for '{param}': {e}.", param=param, code="invalid_value")


def structured_output_fields(response_format: ResponseFormat | None,
                             max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH) -> dict[str, Any]:
    """The SamplingParams fields of `response_format`. Raises ApiError(400) for a json_schema without its
    schema or nested deeper than `max_schema_depth` (refused before admission, never compiled)."""
    if response_format is None or response_format.type == "text":
        return {}
    if response_format.type == "json_object":
        return {"json_object": True}
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise invalid_request("response_format of type 'json_schema' needs json_schema.schema.",
                              param="response_format.json_schema")
    if value_depth(spec.schema_) > max_schema_depth:
        raise too_deep(max_schema_depth, "response_format.json_schema.schema")
    return {"json_schema": spec.schema_}


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias} map with its ids checked against the vocabulary."""
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise invalid_request(f"Invalid key in 'logit_bias': {key[:20]!r} is not a token id in [0, {vocab_size}).",
                                  param="logit_bias", code="invalid_value")
        out[int(key)] = value
    return out
