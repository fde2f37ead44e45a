"""JSON request bodies, parsed with bounds: nesting depth and text that is valid Unicode.

`load_json_body(raw)` is the one way a handler turns body bytes into JSON values. Every way the bytes can
be wrong is a 400 in OpenAI's shape (`invalid_json`), never a 500:

    not JSON / not UTF-8          "We could not parse the JSON body ..."
    nested deeper than max_depth  `json_too_deep` (Python's parser recurses: 10k levels would raise
                                  RecursionError; the depth is counted on the bytes first, without recursion)
    a lone surrogate              `invalid_unicode` ("\\ud800" escapes, or CESU-8 bytes, that stand for no
                                  character; they would fail later when encoded for the tokenizer or a store)

The depth count is a few C-level passes over the body (strings are cut out only when their brackets
could matter) and is skipped when the body holds fewer brackets than the limit; the surrogate walk runs
only when the bytes could spell one.
"""

from __future__ import annotations

import json
import operator
import re
from itertools import accumulate, count
from typing import Any

from gateway.http.errors import ApiError, invalid_request

MAX_JSON_DEPTH = 128  # arrays and objects inside one another; a body's own shape needs < 10
DEFAULT_MAX_SCHEMA_DEPTH = 64  # response_format and tool parameter schemas (GatewayConfig.max_schema_depth)

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN_TWO_CLOSE_ZERO = bytes.maketrans(b"[]{}", b"\x02\x00\x02\x00")
# \uD800-\uDFFF as an escape, or a surrogate encoded as UTF-8 bytes (json.loads decodes 'surrogatepass')
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def load_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body's JSON value. Raises ApiError(400, code invalid_json / json_too_deep / invalid_unicode)."""
    if json_depth_exceeds(raw, max_depth):
        raise too_deep(max_depth)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError):
        raise invalid_request("We could not parse the JSON body of your request. The body must be valid "
                              "JSON.", code="invalid_json") from None
    if _MAYBE_SURROGATE.search(raw) and has_lone_surrogate(data):
        raise invalid_request("The JSON body holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair), "
                              "which is not a character.", code="invalid_unicode")
    return data


def too_deep(max_depth: int, param: str | None = None) -> ApiError:
    return invalid_request(f"The JSON {'value' if param else 'body'} is nested more than {max_depth} levels deep.",
                           param=param, code="json_too_deep")


def json_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether arrays/objects nest more than `max_depth` deep in `raw` (brackets inside strings do not
    count). Malformed input may answer either way; the parser refuses it after. Linear, at C speed."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    return _bracket_depth(_outside_strings(raw)) > max_depth


def _outside_strings(raw: bytes) -> bytes:
    """`raw` without its strings' contents. NOTE: in valid JSON a backslash occurs only inside a string,
    as the first of an escape pair: dropping every `\\\\` pair, then every `\\"`, leaves only the quotes
    that open and close strings, so every other piece between quotes is outside one."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(unescaped.split(b'"')[::2])


def _bracket_depth(raw: bytes) -> int:
    """max over prefixes of (opens - closes): each open is 2, each close 0, minus the bracket's index."""
    steps = raw.translate(_OPEN_TWO_CLOSE_ZERO, _NOT_BRACKETS)
    return max(map(operator.sub, accumulate(steps), count(1)), default=0)


def value_depth(value: Any) -> int:
    """How deep arrays/objects nest in a parsed JSON value (a scalar is 0). Iterative."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in a parsed JSON value (keys included) holds a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
