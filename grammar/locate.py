"""Where in the request's schema a backend's own refusal points.

A backend compiles the normalized schema (grammar/normalize.py) and reports no JSON pointer for what it
refuses then: llguidance's message names a regex, or a place in the normalized schema ("while processing
json-schema:///#/$defs/d18"). `locate` maps that back to a pointer into the schema the request sent: a
regex to the first `pattern` or `patternProperties` key of the normalized schema that spells it, and a
normalized `$defs` entry to the pointer of its source; else the root.

A size refusal ("schema too large": llguidance's fixed budget of schema nodes it builds, which `allOf` of
`anyOf`s multiplies out) names no place either: `locate_oversized` walks down from the root into the
first subschema that is too large on its own, as long as one is; where none of a node's subschemas is,
that node is where the expansion happens. Either way the pointer is cut back to the part of it that
exists in the schema as sent (a rewrite, such as `if`/`then` into `anyOf`, changes the layout below it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from grammar.refs import child_pointer

_PROCESSING = re.compile(r"while processing json-schema:///(#\S*)")
_DEF = re.compile(r"^#/\$defs/([^/]+)(.*)$")


def locate(detail: str, normalized: Any, def_pointers: dict[str, str],
           too_large: Callable[[dict], bool] | None = None) -> tuple[str, str]:
    """(the JSON pointer into the schema as sent that the backend message `detail` concerns, "#" where
    it names no place; the message without its place in the normalized schema). `normalized`: the
    schema the backend compiled; `def_pointers`: its $defs names -> the pointers of their sources.
    `too_large(schema)`: whether the backend refuses `schema` for its size (for a size refusal).
    Outside $defs the normalized schema keeps the sent one's layout."""
    place = _PROCESSING.search(detail)
    message = _PROCESSING.sub("", detail).strip()
    if place:
        pointer: str | None = place.group(1)
    elif too_large is not None and _OVERSIZED in detail:
        pointer = locate_oversized(normalized, too_large)
    else:
        pointer = _pattern_pointer(normalized, detail)
    if pointer is None:
        return "#", message
    named = _DEF.match(pointer)
    if named and named.group(1) in def_pointers:
        return def_pointers[named.group(1)] + named.group(2), message
    return pointer, message


def existing_prefix(schema: Any, pointer: str) -> str:
    """The longest prefix of `pointer` that names a value in `schema`."""
    node, out = schema, "#"
    for raw in pointer.split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            break
        out = f"{out}/{raw}"
    return out


_OVERSIZED = "schema too large"
_MAX_PROBES = 64  # size checks one search may run (each is a backend compile that stops at the limit)


def locate_oversized(normalized: Any, too_large: Callable[[dict], bool]) -> str:
    """The pointer (into `normalized`) of the deepest subschema on the path from the root, each too
    large on its own for the backend; "#" when none below the root is."""
    if not isinstance(normalized, dict):
        return "#"
    defs = normalized.get("$defs") or {}
    node, pointer, probes = normalized, "#", 0
    seen: set[str] = set()
    while True:
        found = None
        for child, child_ptr in sorted(_subschemas(node, pointer, defs, seen), key=lambda c: -len(repr(c[0]))):
            if probes >= _MAX_PROBES:
                return pointer
            probes += 1
            if too_large({**child, "$defs": defs} if defs else child):
                found = child, child_ptr
                break
        if found is None:
            return pointer
        node, pointer = found
        named = _DEF.match(pointer)
        if named:
            seen.add(named.group(1))


_SINGLE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
           "else", "unevaluatedProperties", "unevaluatedItems")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "dependentSchemas")


def _subschemas(node: dict, pointer: str, defs: dict, seen: set[str]) -> Iterator[tuple[dict, str]]:
    """(subschema, pointer) of each object subschema of `node`; a local `$ref` to a `$defs` entry not
    yet walked through stands for that entry."""
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        name = ref[len("#/$defs/"):]
        if name not in seen and isinstance(defs.get(name), dict):
            yield defs[name], ref
    for key in _SINGLE:
        if isinstance(node.get(key), dict):
            yield node[key], child_pointer(pointer, key)
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, value in enumerate(node[key]):
                if isinstance(value, dict):
                    yield value, child_pointer(child_pointer(pointer, key), i)
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, value in node[key].items():
                if isinstance(value, dict):
                    yield value, child_pointer(child_pointer(pointer, key), name)


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
    """`detail` quotes `regex` between slashes, as llguidance prints it: a "/" inside escaped, and (in
    some messages) each of \\d \\D \\w \\W as the ASCII class it compiles it to, also inside a class."""
    for spelling in (regex, _ascii_classes(regex)):
        if f"/{spelling}/" in detail or f"/{spelling.replace('/', chr(92) + '/')}/" in detail:
            return True
    return False


_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9a-zA-Z_]", "W": "[^0-9a-zA-Z_]"}


def _ascii_classes(regex: str) -> str:
    """`regex` with each \\d \\D \\w \\W escape spelt as llguidance prints it (other escapes kept)."""
    out, i = [], 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            out.append(_ASCII_CLASSES.get(regex[i + 1], regex[i : i + 2]))
            i += 2
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)
