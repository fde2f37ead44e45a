"""The last check before a constrained output leaves the worker: validate it with a real validator.

An `OutputGuard` is built once per compiled grammar (it is cached with it) from the spec the request
sent, not from the normalized schema the backend compiled, so it also catches a wrong rewrite and
covers what the grammar only approximates (uniqueItems, the "regex" format). JSON schemas are checked
by python-jsonschema in the schema's own draft with its format checker (the format-nongpl extra
supplies date-time, hostname, uri, ...); choice grammars by membership; json_object by parsing.
Regex grammars are re-checked with a full match by the `regex` module where the pattern keeps to the
syntax it shares with the Rust dialect the grammar compiled (`rechecks_regex`); a pattern with Rust-only
syntax (class set operations, POSIX classes, inline flags) is not re-checked.

A failure here means the grammar admitted something the spec does not: a bug. The caller counts it,
logs it with `digest`, and fails the request instead of returning the text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

import jsonschema
import regex
from jsonschema.validators import (
    Draft4Validator,
    Draft6Validator,
    Draft7Validator,
    Draft201909Validator,
    Draft202012Validator,
    extend,
)

from grammar.keywords import dialect_of
from grammar.spec import GrammarSpec


@functools.lru_cache(maxsize=8192)
def compile_pattern(pattern: str) -> Any:
    """A compiled `pattern`: Python's `re` where it takes it, else the `regex` module, which also reads
    the \\p{...} classes that schemas written for ECMA-262 and Rust engines use. Raises their error."""
    try:
        return re.compile(pattern)
    except re.error:
        return regex.compile(pattern)


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not compile_pattern(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, pattern_properties, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for name, value in instance.items():
            if compile_pattern(pattern).search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _with_patterns(cls):
    return extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})


_VALIDATORS = {"draft4": _with_patterns(Draft4Validator), "draft6": _with_patterns(Draft6Validator),
               "draft7": _with_patterns(Draft7Validator), "draft2019": _with_patterns(Draft201909Validator),
               "draft2020": _with_patterns(Draft202012Validator)}


def schema_validator(schema: dict) -> Any:
    """A python-jsonschema validator for `schema` in its own draft, format checker on, with patterns
    compiled by `compile_pattern`."""
    cls = _VALIDATORS[dialect_of(schema)]
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


# Rust regex syntax that the `regex` module reads otherwise (or not at all): no re-check for these.
_RUST_ONLY = ("[[", "&&", "--", "~~", "\\z", "\\A", "\\Q")
_INLINE_GROUP = re.compile(r"\(\?(?!:)")


def rechecks_regex(pattern: str) -> bool:
    """Whether the guard re-checks outputs of this regex grammar (it reads the same in both dialects)."""
    return not any(token in pattern for token in _RUST_ONLY) and not _INLINE_GROUP.search(pattern)


class OutputGuard:
    """Validates finished outputs of one spec. Thread-safe after construction; `check` mutates nothing.

    digest: first 16 hex digits of the SHA-256 of the canonical spec (log it, never the schema).
    """

    def __init__(self, spec: GrammarSpec) -> None:
        self.kind = spec.kind
        self.digest = hashlib.sha256(f"{spec.kind}:{spec.value}".encode()).hexdigest()[:16]
        self._validator: Any = None
        self._choices: frozenset[str] = frozenset()
        self._regex: Any = None
        if spec.kind in ("json_schema", "json_object"):
            self._validator = schema_validator(spec.schema())
        elif spec.kind == "choice":
            self._choices = frozenset(spec.choices())
        elif spec.kind == "regex" and rechecks_regex(spec.value):
            try:
                self._regex = regex.compile(spec.value)
            except regex.error:  # valid Rust syntax the regex module does not read: not re-checked
                self._regex = None

    def check(self, text: str) -> str | None:
        """None if `text` satisfies the spec, else why not (short; no instance data beyond a path)."""
        if self.kind == "choice":
            return None if text in self._choices else "the output is not one of the choices"
        if self._regex is not None:
            return None if self._regex.fullmatch(text) else "the output does not match the regex"
        if self._validator is None:
            return None
        try:
            instance = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            return f"the output is not valid JSON ({type(e).__name__} at position {getattr(e, 'pos', '?')})"
        try:
            error = jsonschema.exceptions.best_match(self._validator.iter_errors(instance))
        except RecursionError:
            return "the output nests too deeply to validate"
        if error is None:
            return None
        path = "/".join(str(p) for p in error.absolute_path)
        return f"the output fails its schema at /{path}: keyword {error.validator!r}"
