"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models[/{id}].

Each handler: scope check → body validation → model resolution → the cheap checks of messages and tools,
an estimate of the prompt's tokens and the request's one SamplingParams (gateway/openai/prompt.py) →
admission (the policies seam, charged with the estimate) → the prompt rendered and tokenized in the
prompt pool, off the event loop → a GenerationResponse that streams or collects the engine's deltas.

Prefix caching, three names for three things: a tenant's `cache_salt` (chosen by the server, never by a
client), the public sharing choice (the tenant policy `share_prefix_cache`: its requests use
`PUBLIC_CACHE_SALT`), and the radix cache's namespace, which the engine keys by the request's salt and
its adapter's content (wire.protocol.prefix_namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import replace

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.adapters.resolver import ResolvedModel
from gateway.admission.base import AdmissionRequest, Admitted, FinalUsage
from gateway.auth.backend import TENANT_SCOPE, TenantUser, require_scope
from gateway.http.errors import invalid_request, model_not_found
from gateway.openai.format import ChatFormatter, CompletionFormatter, Formatter
from gateway.openai.generation import Generation, GenerationResponse
from gateway.openai.params import refuse_unsupported, request_labels, requested_priority
from gateway.openai.prompt import (
    chat_inputs,
    chat_prompt_ids,
    completion_inputs,
    completion_prompt_ids,
    estimated_completion_tokens,
    sampling_params,
    tool_constraint,
)
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, parse_body
from gateway.state import GatewayState
from gateway.store import Tenant
from policies import RequestTooLarge
from tokenization.tokenizer import Tokenizer
from wire.protocol import GenerateRequest
from wire.sampling import SamplingParams

PUBLIC_CACHE_SALT = "public"


def request_cache_salt(tenant: Tenant) -> str:
    """The cache salt of a tenant's requests: its own, unless an operator shares its prefixes (policy
    `share_prefix_cache`, see policies.TenantPolicy)."""
    return PUBLIC_CACHE_SALT if tenant.policy.share_prefix_cache else tenant.cache_salt


def gateway_state(request: Request) -> GatewayState:
    return request.state.gateway


async def chat_completions(request: Request) -> Response:
    user = require_scope(request, TENANT_SCOPE)
    body: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
    state = gateway_state(request)
    resolved = await _resolve(state, user, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    refuse_unsupported(body)
    priority, tier = requested_priority(body.priority, body.service_tier, user.tenant.policy)
    inputs = chat_inputs(state.tool_calling, body, state.config.max_schema_depth)
    requested = body.requested_max_tokens
    max_tokens = state.config.default_max_tokens if requested is None else requested
    tools = tool_constraint(state.tool_calling, inputs.tools)
    sampling = sampling_params(body, max_tokens, logprobs, vocab_size=state.tokenizer.vocab_size, tools=tools,
                               max_schema_depth=state.config.max_schema_depth)
    formatter = ChatFormatter(_new_id("chatcmpl"), resolved.served_name, state.token_text, logprobs is not None,
                              service_tier=tier, tools=state.tool_calling.format if tools else None,
                              special_token_ids=state.tokenizer.special_token_ids)

    async def render() -> list[list[int]]:
        return [await state.prompts.run(user.tenant.id, chat_prompt_ids, state.tokenizer, inputs)]

    return await _start(request, state, user, body, resolved, (inputs.estimated_tokens(), 1), render, sampling,
                        formatter, priority)


async def completions(request: Request) -> Response:
    user = require_scope(request, TENANT_SCOPE)
    body: CompletionRequest = parse_body(await request.body(), CompletionRequest)
    state = gateway_state(request)
    resolved = await _resolve(state, user, body.model)
    if body.echo and body.logprobs is not None:
        raise invalid_request("echo with logprobs is not supported (prompt logprobs are not computed).",
                              param="echo", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid_request("best_of other than n is not supported.", param="best_of")
    if body.suffix:
        raise invalid_request("suffix is not supported.", param="suffix")
    prompts = completion_inputs(body)
    max_tokens = state.config.default_completion_max_tokens if body.max_tokens is None else body.max_tokens
    sampling = sampling_params(body, max_tokens, body.logprobs, vocab_size=state.tokenizer.vocab_size,
                               max_schema_depth=state.config.max_schema_depth)
    formatter = CompletionFormatter(_new_id("cmpl"), resolved.served_name, state.token_text,
                                    body.logprobs is not None, n=body.n)

    async def render() -> list[list[int]]:
        ids = await state.prompts.run(user.tenant.id, completion_prompt_ids, state.tokenizer, prompts)
        if body.echo:  # each prompt's text, put before its choices' text
            formatter.echo = await state.prompts.run(user.tenant.id, _echo_texts, state.tokenizer, prompts)
        return ids

    return await _start(request, state, user, body, resolved, (estimated_completion_tokens(prompts), len(prompts)),
                        render, sampling, formatter, body.priority)


def _echo_texts(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[str]:
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]


async def _start(request: Request, state: GatewayState, user: TenantUser,
                 body: ChatCompletionRequest | CompletionRequest, resolved: ResolvedModel, estimate: tuple[int, int],
                 render: Callable[[], Awaitable[list[list[int]]]], sampling: SamplingParams, formatter: Formatter,
                 priority: int | None) -> Response:
    """Admit, then render, then answer the request: one engine request per prompt (a completions prompt
    list has several), their samples numbered prompt by prompt.

    Admission comes first and charges an estimate (`estimate`: prompt tokens, number of prompts) so that
    a tenant at its limits gets its 429 before any expensive work; rendering and tokenizing run in the
    prompt pool after it, and the exact count is checked against the tenant's max_tokens_per_request
    (a 400 with the request still charged); the reservation is reconciled with the tokens served."""
    labels = request_labels(body, formatter.response_id, user.key.id, resolved.adapter)
    estimated_tokens, num_prompts = estimate
    policy = user.tenant.policy
    n = body.n * num_prompts
    # NOTE: the estimate never refuses on its own a request whose exact count could fit
    room = max(0, policy.max_tokens_per_request - sampling.max_tokens * n)
    ticket = AdmissionRequest(
        request_id=formatter.response_id, tenant=user.tenant, model=resolved.served_name,
        requested_priority=priority, prompt_tokens=min(estimated_tokens, room), max_tokens=sampling.max_tokens, n=n,
    )
    admitted = await _admit_while_connected(request, state, ticket)  # may raise ApiError (429, 503, 400)
    if admitted is None:
        return Response(status_code=499)  # the client left while queued; nobody reads this
    try:
        prompts = await render()
        prompt_tokens = sum(len(p) for p in prompts)
        try:
            policy.check_request_size(prompt_tokens, sampling.max_tokens * n)
        except RequestTooLarge as e:
            raise invalid_request(str(e), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                                  code="request_too_large") from None
        ticket = replace(ticket, prompt_tokens=prompt_tokens)
        engine_requests = [GenerateRequest(
            request_id=formatter.response_id if len(prompts) == 1 else f"{formatter.response_id}-{i}",
            prompt_token_ids=prompt_ids, sampling=sampling, priority=admitted.priority,
            adapter=resolved.adapter_spec(state.adapter_root), cache_salt=request_cache_salt(user.tenant),
            traceparent=request.headers.get("traceparent"),
        ) for i, prompt_ids in enumerate(prompts)]
        generation = Generation(ticket, admitted, engine_requests[0], formatter, body.n * len(prompts), body.stream,
                                body.include_usage, more_requests=tuple(engine_requests[1:]), labels=labels)
        return GenerationResponse(generation, state.engine, state.admission, state.usage)
    except BaseException:
        # NOTE: from here on GenerationResponse owns the release; until then a failure must release here.
        await state.admission.release(ticket, admitted, FinalUsage(0, 0, 0, "error"))
        raise


async def _admit_while_connected(request: Request, state: GatewayState, ticket: AdmissionRequest) -> Admitted | None:
    """Admission (which may wait in the fair queue), abandoned if the client disconnects meanwhile.

    Returns None when the client went away; the admission's own cancellation releases what it took.
    """
    admit = asyncio.ensure_future(state.admission.admit(ticket))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({admit, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if admit.done():
        return admit.result()
    admit.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await admit
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def list_models(request: Request) -> Response:
    user = require_scope(request, TENANT_SCOPE)
    state = gateway_state(request)
    cards = await run_in_threadpool(state.resolver.list_models, user.tenant)
    return JSONResponse({"object": "list", "data": [c.to_json() for c in cards]})


async def get_model(request: Request) -> Response:
    user = require_scope(request, TENANT_SCOPE)
    state = gateway_state(request)
    model_id = request.path_params["model_id"]
    cards = await run_in_threadpool(state.resolver.list_models, user.tenant)
    for card in cards:
        if card.id == model_id:
            return JSONResponse(card.to_json())
    raise model_not_found(model_id)


async def _resolve(state: GatewayState, user: TenantUser, model: str) -> ResolvedModel:
    if model == state.resolver.base_name:  # no store read: spare the thread hop
        return ResolvedModel(model, None)
    resolved = await run_in_threadpool(state.resolver.resolve, user.tenant, model)
    if resolved is None:
        raise model_not_found(model)
    return resolved


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
]
