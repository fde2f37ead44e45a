"""Refuse, before compiling, any JSON schema a backend would not enforce exactly.

Published comparisons show engines silently ignoring keywords (integer ranges, minItems/maxItems,
uniqueItems) and so passing invalid outputs. `check_schema` walks the whole schema (following local
$refs) and raises GrammarError naming the JSON pointer and keyword of the first thing that is
invalid, unknown, unsatisfiable, or on the backend's `unsupported_keywords` list. Annotations
(title, description, ...) and "x-" extension keys are allowed and ignored; other unknown keywords
are refused, since a misspelt "maxitems" would otherwise constrain nothing.
"""

from __future__ import annotations

import math
import re
from typing import Any

from grammar.backend import GrammarBackend
from grammar.spec import GrammarError

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
     "readOnly", "writeOnly", "contentMediaType", "contentEncoding"}
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMAS = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OTHER = ("type", "required", "enum", "const", "pattern", "format", "$ref", "uniqueItems",
          "dependentRequired")
KNOWN_KEYWORDS = frozenset((*_SCHEMA_MAPS, *_SCHEMAS, *_SCHEMA_LISTS, *_COUNTS, *_NUMBERS, *_OTHER))
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
           ("minimum", "maximum"))
# Nodes visited (counting every $ref expansion) before a schema counts as too large to check.
MAX_VISITS = 20_000


def check_schema(schema: dict, backend: GrammarBackend, max_ref_depth: int) -> None:
    """Raise GrammarError unless `backend` enforces every keyword of `schema`. Mutates nothing."""
    _Walker(schema, backend, max_ref_depth).visit(schema, "#", ())


def _child(pointer: str, key: str | int) -> str:
    return f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class _Walker:
    def __init__(self, root: dict, backend: GrammarBackend, max_ref_depth: int) -> None:
        self.root = root
        self.backend = backend
        self.max_ref_depth = max_ref_depth
        self.visits = 0

    def fail(self, pointer: str, message: str) -> GrammarError:
        return GrammarError(f"json_schema at {pointer}: {message}")

    def visit(self, node: Any, pointer: str, refs: tuple[str, ...]) -> None:
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise self.fail(pointer, f"schema is too large to check (more than {MAX_VISITS} nodes after $ref expansion)")
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise self.fail(pointer, f"a schema must be an object or a boolean, got {type(node).__name__}")
        for key, value in node.items():
            if key in ANNOTATIONS or key.startswith("x-"):
                continue
            where = _child(pointer, key)
            if key not in KNOWN_KEYWORDS:
                raise self.fail(where, f"unknown keyword {key!r} (refused rather than ignored)")
            if key in self.backend.unsupported_keywords:
                raise self.fail(where, f"keyword {key!r} is not supported: the {self.backend.name} backend "
                                       "would not enforce it")
            self.check_keyword(key, value, where, refs)
        self.check_bounds(node, pointer)

    def check_keyword(self, key: str, value: Any, where: str, refs: tuple[str, ...]) -> None:
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise self.fail(where, f"{key!r} must be an object of schemas")
            for name, sub in value.items():
                if key == "patternProperties":
                    self.check_regex(name, _child(where, name))
                self.visit(sub, _child(where, name), refs)
        elif key in _SCHEMAS:
            if isinstance(value, list):
                raise self.fail(where, f"{key!r} must be a schema (use prefixItems for tuples)")
            self.visit(value, where, refs)
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise self.fail(where, f"{key!r} must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                self.visit(sub, _child(where, i), refs)
        elif key in _COUNTS:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise self.fail(where, f"{key!r} must be a non-negative integer, got {value!r}")
        elif key in _NUMBERS:
            if not _is_number(value) or (key == "multipleOf" and value <= 0):
                raise self.fail(where, f"{key!r} must be a {'positive ' if key == 'multipleOf' else ''}number, "
                                       f"got {value!r}")
        elif key == "type":
            names = value if isinstance(value, list) else [value]
            if not names or len(set(map(str, names))) != len(names) or not all(n in TYPES for n in names):
                raise self.fail(where, f"'type' must be one of {sorted(TYPES)} or a list of them, got {value!r}")
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise self.fail(where, "'required' must be a list of property names")
        elif key == "enum":
            if not isinstance(value, list) or not value:
                raise self.fail(where, "'enum' must be a non-empty list")
        elif key == "pattern":
            self.check_regex(value, where)
        elif key == "format":
            if value not in self.backend.supported_formats:
                raise self.fail(where, f"format {value!r} is not enforced by the {self.backend.name} backend "
                                       f"(supported: {', '.join(sorted(self.backend.supported_formats))})")
        elif key == "$ref":
            self.follow_ref(value, where, refs)
        elif key == "uniqueItems" and not isinstance(value, bool):
            raise self.fail(where, "'uniqueItems' must be a boolean")

    def check_regex(self, pattern: Any, where: str) -> None:
        if not isinstance(pattern, str):
            raise self.fail(where, f"a pattern must be a string, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise self.fail(where, f"invalid pattern {pattern!r}: {e}") from None

    def check_bounds(self, node: dict, pointer: str) -> None:
        for low, high in _BOUNDS:
            if low in node and high in node and node[low] > node[high]:
                raise self.fail(pointer, f"unsatisfiable: {low} {node[low]} > {high} {node[high]}")
        if node.get("additionalProperties") is False and isinstance(node.get("required"), list):
            allowed = node.get("properties") or {}
            for name in node["required"]:
                if name not in allowed and not node.get("patternProperties"):
                    raise self.fail(pointer, f"unsatisfiable: required property {name!r} is not in 'properties' "
                                             "and additionalProperties is false")

    def follow_ref(self, ref: Any, where: str, refs: tuple[str, ...]) -> None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.fail(where, f"only local JSON-pointer $refs ('#/...') are supported, got {ref!r}")
        if ref in refs:
            if not self.backend.supports_recursive_ref:
                raise self.fail(where, f"recursive $ref {ref!r} is not supported by the {self.backend.name} backend")
            return
        if len(refs) >= self.max_ref_depth:
            raise self.fail(where, f"$ref chain deeper than the limit of {self.max_ref_depth}: {' -> '.join(refs)}")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise self.fail(where, f"unresolvable $ref {ref!r}")
        self.visit(target, ref, (*refs, ref))
