"""Hypothesis-made bodies for the OpenAI routes, in and around the schema: every answer is < 500 and,
when it is an error, OpenAI's shape.

A body starts valid (a tiny greedy request for the served model) and is then bent: a field (top level or
nested: message content and role, the json_schema, a tool's parameters, logit_bias, stop) takes any JSON
value — wrong types, integers far past 64 bits, huge and non-finite floats (`1e999`, `NaN`, `Infinity`:
Python's json reads them), long and odd unicode, lone surrogates escaped as JSON allows (`"\\ud800"`) —
unknown fields are added, or a value is nested thousands deep. Bodies are sent as raw bytes (httpx), so
whatever JSON text the strategy writes is what the gateway reads. A fixed seed per route, no example
database: the same bodies every run.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.fuzz.openai_errors import error_shape_problem
from tests.gateway.conftest import BASE_MODEL

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz")]

EXAMPLES = 25
LONG_EXAMPLES = 1000

CHAT = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": BASE_MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
SAMPLING_FIELDS = ["model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                   "frequency_penalty", "user", "stream", "stream_options", "logit_bias", "priority", "top_k",
                   "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "response_format"]
CHAT_FIELDS = [*SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
               "tool_choice", "parallel_tool_calls", "service_tier", "metadata", "chat_template_kwargs",
               ("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0, "name"),
               ("response_format", "json_schema", "schema"), ("tools", 0, "function", "parameters"),
               ("logit_bias", "7"), ("stop", 0)]
COMPLETION_FIELDS = [*SAMPLING_FIELDS, "prompt", "logprobs", "echo", "best_of", "suffix", ("prompt", 0)]

# Raw JSON tokens json.dumps never writes but a client may send (Python's json.loads reads them all).
NON_FINITE = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
BIG_INTS = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.integers().map(lambda i: i * 2**64),
                     st.sampled_from([2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63) - 1, 10**400]))
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 5e-324]))
PLAIN = st.text(max_size=40)
TEXT = st.one_of(PLAIN, PLAIN, PLAIN, st.text(st.characters(codec="utf-8"), min_size=1000, max_size=3000),
                 st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3),  # lone surrogates
                 st.sampled_from(["<|im_start|>system", "<s>", "</s>", "\x00", "\ufeff", "\U0010ffff"]))
LEAVES = st.one_of(st.none(), st.booleans(), BIG_INTS, FLOATS, TEXT)
JSON_VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


class Raw(str):
    """JSON text to splice into the body as is (a non-finite token, or nesting json.dumps cannot write)."""


def deep(depth: int, opener: str) -> Raw:
    closer = {"[": "]", '{"a":': "}"}[opener]
    return Raw(opener * depth + "1" + closer * depth)


VALUES = st.one_of(JSON_VALUES, NON_FINITE.map(Raw),
                   st.builds(deep, st.integers(min_value=1, max_value=20_000), st.sampled_from(["[", '{"a":'])))


def dumps(value: Any) -> str:
    """JSON text of `value`, Raw pieces spliced in; lone surrogates come out as \\udXXX escapes."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: every non-ASCII char (a surrogate too) as an escape


def put(body: dict, where: str | tuple, value: Any) -> dict:
    """A copy of `body` with `value` at `where` (a field, or a path whose missing parts are made)."""
    body = json.loads(json.dumps(body))
    path = (where,) if isinstance(where, str) else where
    node: Any = body
    for part, following in zip(path, path[1:], strict=False):
        if isinstance(node, list):
            while len(node) <= part:
                node.append({} if isinstance(following, str) else [])
            node = node[part]
        else:
            if not isinstance(node.get(part), dict | list):
                node[part] = {} if isinstance(following, str) else []
            node = node[part]
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value
    return body


@st.composite
def bodies(draw, base: dict, fields: list) -> str:
    body = base
    for _ in range(draw(st.integers(min_value=0, max_value=2))):  # 0: only unknown fields
        body = put(body, draw(st.sampled_from(fields)), draw(VALUES))
    extras = draw(st.dictionaries(st.text(min_size=1, max_size=12), JSON_VALUES, max_size=3))
    return dumps({**body, **{k: v for k, v in extras.items() if k not in body}})


def post_bodies(stack, path: str, base: dict, fields: list, examples: int) -> Counter:
    statuses: Counter = Counter()
    codes: Counter = Counter()  # error codes of the 4xx answers
    failures: list[str] = []
    headers = {**stack.headers(stack.fuzzer_key), "content-type": "application/json"}

    with httpx.Client(base_url=stack.url, headers=headers, timeout=120) as client:

        @seed(zlib.crc32(path.encode()))  # fixed, and not the same for both routes
        @settings(max_examples=examples, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(text=bodies(base, fields))
        def run(text: str) -> None:
            resp = client.post(path, content=text.encode("utf-8", "surrogatepass"))
            statuses[resp.status_code] += 1
            if 400 <= resp.status_code < 500 and error_shape_problem(resp.status_code, resp.text) is None:
                codes[resp.json()["error"]["code"]] += 1
            problem = f"{resp.status_code}: {resp.text[:200]!r}" if resp.status_code >= 500 else None
            problem = problem or error_shape_problem(resp.status_code, resp.text)
            if problem is not None:
                failures.append(f"{problem} | body {text[:300]!r}")

        started = time.monotonic()
        run()
        print(f"\n{path}: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}, "
              f"{time.monotonic() - started:.1f} s; error codes {dict(codes.most_common())}")
        for line in failures[:20]:
            print("  FAIL", line)
        assert not failures, failures[:5]
        # and the gateway still serves an ordinary request
        assert client.post(path, json=base).status_code == 200
    return statuses


@pytest.mark.parametrize("path, base, fields", [("/v1/chat/completions", CHAT, CHAT_FIELDS),
                                                 ("/v1/completions", COMPLETION, COMPLETION_FIELDS)],
                         ids=["chat", "completions"])
def test_bent_bodies_get_4xx_in_openai_shape(fuzz_stack, path, base, fields):
    statuses = post_bodies(fuzz_stack, path, base, fields, EXAMPLES)
    assert sum(statuses.values()) == EXAMPLES


@pytest.mark.long
@pytest.mark.parametrize("path, base, fields", [("/v1/chat/completions", CHAT, CHAT_FIELDS),
                                                 ("/v1/completions", COMPLETION, COMPLETION_FIELDS)],
                         ids=["chat", "completions"])
def test_bent_bodies_longer(fuzz_stack, path, base, fields):
    post_bodies(fuzz_stack, path, base, fields, LONG_EXAMPLES)
