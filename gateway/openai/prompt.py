"""Validated OpenAI bodies → prompt token ids and the request's `SamplingParams`.

Chat messages go through the model's chat template (sandboxed Jinja in tokenization/tokenizer.py); the
rendered text already holds BOS, so it is tokenized without adding special tokens again. The sampling
spec is built here, once, and travels as it is to the sampler: its bounds are SamplingParams' own, and a
value out of them is a 400 naming the body's param.
"""

from __future__ import annotations

from typing import Any

from gateway.http.errors import ApiError, invalid_request
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, ResponseFormat
from tokenization.tokenizer import ChatTemplateError, Tokenizer
from wire.sampling import InvalidSamplingParams, SamplingParams


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise invalid_request(str(e), param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompt_ids(tokenizer: Tokenizer, body: CompletionRequest) -> list[int]:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise invalid_request("Batched prompts are not supported: send one prompt per request.",
                                  param="prompt")
        prompt = prompt[0]
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
                    logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams. Raises ApiError(400) naming the body's param for a value that
    SamplingParams refuses (`max_tokens` and `logprobs` are what the caller read from the body)."""
    fields: dict[str, Any] = {"n": body.n, "max_tokens": max_tokens, "ignore_eos": body.ignore_eos}
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
