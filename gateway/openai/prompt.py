"""Validated OpenAI bodies → prompt token ids and the request's `SamplingParams`.

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
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, NamedToolChoice, ResponseFormat
from gateway.openai.tools.messages import template_messages
from gateway.openai.tools.plan import ToolPlan, plan_tools
from tokenization.chat_template import RESERVED_VARIABLES
from tokenization.tokenizer import ChatTemplateError, Tokenizer
from tokenization.tool_formats import ToolCalling
from wire.sampling import ConstrainedTool, InvalidSamplingParams, SamplingParams, ToolCallConstraint


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt: token ids, and its tools as checked once (None without tools)."""

    token_ids: list[int]
    tools: ToolPlan | None


def chat_prompt(tokenizer: Tokenizer, calling: ToolCalling, body: ChatCompletionRequest) -> ChatPrompt:
    """Render and tokenize the conversation with its tools. Raises ApiError(400) naming the param: a tool
    or tool_choice (gateway/openai/tools/plan.py), a message field, chat_template_kwargs, or `messages`
    for the template's own refusal (its message, e.g. a `raise_exception` text)."""
    tools = None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools]
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    plan = plan_tools(tools, choice, body.parallel_tool_calls)
    kwargs = body.chat_template_kwargs or {}
    reserved = sorted(RESERVED_VARIABLES & kwargs.keys())
    if reserved:
        raise invalid_request(f"chat_template_kwargs may not set {reserved[0]!r}.", param="chat_template_kwargs",
                              code="invalid_value")
    messages, template_tools = template_messages([m.template_fields() for m in body.messages], calling, plan)
    try:
        ids = tokenizer.encode_chat(messages, tools=template_tools, template_kwargs=kwargs)
    except ChatTemplateError as e:
        raise invalid_request(str(e), param="messages") from None
    return ChatPrompt(ids, plan)


def tool_constraint(calling: ToolCalling, plan: ToolPlan | None) -> ToolCallConstraint | None:
    """The grammar's share of the plan: which tools a call may name, in the served model's format."""
    if plan is None or not plan.constrains:
        return None
    tools = tuple(ConstrainedTool(plan.tools.index(t), t.name, t.parameters) for t in plan.allowed)
    return ToolCallConstraint(calling.format.name, tools, plan.mode, plan.parallel)


MAX_PROMPTS = 64  # prompts in one completions request


def completion_prompts(tokenizer: Tokenizer, body: CompletionRequest) -> list[list[int]]:
    """The token ids of each prompt: a string, a list of ids, or a list of either (one choice per
    prompt and sample). Raises ApiError(400) naming `prompt`."""
    prompt: Any = body.prompt
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise invalid_request(f"At most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompts)}.",
                              param="prompt")
    return [_prompt_ids(tokenizer, p) for p in prompts]


def _prompt_ids(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_request("The prompt must not be empty.", param="prompt")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if not prompt:
        raise invalid_request("The prompt must not be empty.", param="prompt")
    if any(t < 0 or t >= tokenizer.vocab_size for t in prompt):
        raise invalid_request(f"Prompt token ids must be in [0, {tokenizer.vocab_size}).", param="prompt")
    return list(prompt)


def sampling_params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                    logprobs: int | None, *, vocab_size: int, tools: ToolCallConstraint | None = None) -> SamplingParams:
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
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    fields.update(structured_output_fields(body.response_format))
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


def structured_output_fields(response_format: ResponseFormat | None) -> dict[str, Any]:
    if response_format is None or response_format.type == "text":
        return {}
    if response_format.type == "json_object":
        return {"json_object": True}
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise invalid_request("response_format of type 'json_schema' needs json_schema.schema.",
                              param="response_format.json_schema")
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
