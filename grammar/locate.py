"""Where in the request's schema a backend's own refusal points.

A backend compiles the normalized schema (grammar/normalize.py) and reports no JSON pointer for what it
refuses then: llguidance's message names a regex, or a place in the normalized schema ("while processing
json-schema:///#/$defs/d18"). `locate` maps that back to a pointer into the schema the request sent: a
regex to the first `pattern` or `patternProperties` key of the normalized schema that spells it, and a
normalized `$defs` entry to the pointer of its source; else the root.
"""

from __future__ import annotations

import re
from typing import Any

from grammar.refs import child_pointer

_PROCESSING = re.compile(r"while processing json-schema:///(#\S*)")
_DEF = re.compile(r"^#/\$defs/([^/]+)(.*)$")


def locate(detail: str, normalized: Any, def_pointers: dict[str, str]) -> tuple[str, str]:
    """(the JSON pointer into the schema as sent that the backend message `detail` concerns, "#" where
    it names no place; the message without its place in the normalized schema). `normalized`: the
    schema the backend compiled; `def_pointers`: its $defs names -> the pointers of their sources.
    Outside $defs the normalized schema keeps the sent one's layout."""
    place = _PROCESSING.search(detail)
    message = _PROCESSING.sub("", detail).strip()
    pointer = place.group(1) if place else _pattern_pointer(normalized, detail)
    if pointer is None:
        return "#", message
    named = _DEF.match(pointer)
    if named and named.group(1) in def_pointers:
        return def_pointers[named.group(1)] + named.group(2), message
    return pointer, message


def _pattern_pointer(root: Any, detail: str) -> str | None:
    """The first (depth-first, in key order) `pattern` value or `patternProperties` key that the
    message quotes as /regex/."""
    stack: list[tuple[Any, str]] = [(root, "#")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str) and _quotes(detail, pattern):
                return child_pointer(pointer, "pattern")
            names = node.get("patternProperties")
            if isinstance(names, dict):
                for name in names:
                    if _quotes(detail, name):
                        return child_pointer(child_pointer(pointer, "patternProperties"), name)
            stack.extend((value, child_pointer(pointer, key)) for key, value in reversed(list(node.items())))
        elif isinstance(node, list):
            stack.extend((value, child_pointer(pointer, i)) for i, value in reversed(list(enumerate(node))))
    return None


def _quotes(detail: str, regex: str) -> bool:
    """`detail` quotes `regex` between slashes, as llguidance prints it: a "/" inside escaped, "\\d" as
    "[0-9]" (it compiles \\d as ASCII digits)."""
    for spelling in (regex, regex.replace("\\d", "[0-9]")):
        if f"/{spelling}/" in detail or f"/{spelling.replace('/', chr(92) + '/')}/" in detail:
            return True
    return False
