"""Formats enforced by rewriting them into a `pattern`, and regex syntax checks in the backend's dialect.

Each pattern below is the grammar of its RFC written as a regular expression (ASCII classes only: the
Rust regex engine's \\d and \\w are Unicode-aware), so the rewrite is exact: a string matches the
pattern exactly when the format checker of python-jsonschema (format-nongpl) accepts it.
"""

from __future__ import annotations

import functools
import re

import llguidance

_UNRESERVED = r"A-Za-z0-9\-._~"
_SUB_DELIMS = r"!$&'()*+,;="
_PCT = r"%[0-9A-Fa-f]{2}"
_PCHAR = rf"(?:[{_UNRESERVED}{_SUB_DELIMS}:@]|{_PCT})"
_H16 = r"[0-9A-Fa-f]{1,4}"
_DEC_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
_IPV4 = rf"{_DEC_OCTET}\.{_DEC_OCTET}\.{_DEC_OCTET}\.{_DEC_OCTET}"
_LS32 = rf"(?:{_H16}:{_H16}|{_IPV4})"
_IPV6 = "(?:" + "|".join([
    rf"(?:{_H16}:){{6}}{_LS32}",
    rf"::(?:{_H16}:){{5}}{_LS32}",
    rf"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
    rf"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
    rf"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
    rf"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
    rf"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
    rf"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
    rf"(?:(?:{_H16}:){{0,6}}{_H16})?::",
]) + ")"
_IPVFUTURE = rf"v[0-9A-Fa-f]+\.[{_UNRESERVED}{_SUB_DELIMS}:]+"
_HOST = rf"(?:\[(?:{_IPV6}|{_IPVFUTURE})\]|(?:[{_UNRESERVED}{_SUB_DELIMS}]|{_PCT})*)"
_AUTHORITY = rf"(?:(?:[{_UNRESERVED}{_SUB_DELIMS}:]|{_PCT})*@)?{_HOST}(?::[0-9]*)?"
_SEGMENT = rf"{_PCHAR}*"
_PATH_ABEMPTY = rf"(?:/{_SEGMENT})*"
_PATH_ABSOLUTE = rf"/(?:{_PCHAR}+(?:/{_SEGMENT})*)?"
_PATH_NOSCHEME = rf"(?:[{_UNRESERVED}{_SUB_DELIMS}@]|{_PCT})+(?:/{_SEGMENT})*"
_PATH_ROOTLESS = rf"{_PCHAR}+(?:/{_SEGMENT})*"
_QUERY = rf"(?:{_PCHAR}|[/?])*"
_SCHEME = r"[A-Za-z][A-Za-z0-9+\-.]*"
_HIER = rf"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_PATH_ROOTLESS}|)"
_RELATIVE = rf"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_PATH_NOSCHEME}|)"
_URI = rf"{_SCHEME}:{_HIER}(?:\?{_QUERY})?(?:#{_QUERY})?"
_RELATIVE_REF = rf"{_RELATIVE}(?:\?{_QUERY})?(?:#{_QUERY})?"
_JSON_POINTER = r"(?:/(?:[^~/]|~[01])*)*"

# format -> anchored pattern with the same language
FORMAT_PATTERNS: dict[str, str] = {
    "json-pointer": rf"^{_JSON_POINTER}$",
    "relative-json-pointer": rf"^(?:0|[1-9][0-9]*)(?:#|{_JSON_POINTER})$",
    "uri-reference": rf"^(?:{_URI}|{_RELATIVE_REF})$",
}


@functools.lru_cache(maxsize=4096)
def rust_regex_error(pattern: str) -> str:
    """Why `pattern` is not a valid regex for the backend (Rust `regex` syntax), or "" if it is."""
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern))
    if not error:
        return ""
    detail = next((ln.strip() for ln in error.splitlines() if ln.strip().startswith("error:")), "")
    return detail.removeprefix("error: ") or error


_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")
_CLASS_UNIT = re.compile(r"\\u([0-9A-Fa-f]{4})(?:-\\u([0-9A-Fa-f]{4}))?")


def _without_surrogates(low: int, high: int) -> str:
    """A class range (\\uXXXX-\\uYYYY) less the surrogate code points, which Rust refuses and which no
    decoded string holds where Python matches (Python reads a pair as one astral character)."""
    pieces = [(a, b) for a, b in ((low, min(high, 0xD7FF)), (max(low, 0xE000), high)) if a <= b]
    return "".join(f"\\u{a:04X}" if a == b else f"\\u{a:04X}-\\u{b:04X}" for a, b in pieces)


def python_to_rust(pattern: str) -> str:
    """The same pattern in Rust syntax where Python's differs without a change of meaning: `\\Z` (end
    of text) is `\\z`, a `-` right after a class escape inside [...] is a literal, which Rust wants
    escaped, and surrogate code points leave classes. Everything else is passed through."""
    if "\\" not in pattern:
        return pattern
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        ch = pattern[i]
        unit = _CLASS_UNIT.match(pattern, i) if in_class and ch == "\\" else None
        if unit is not None:
            out.append(_without_surrogates(int(unit.group(1), 16), int(unit.group(2) or unit.group(1), 16)))
            i = unit.end()
            continue
        if ch == "\\" and i + 1 < n:
            escape = pattern[i : i + 2]
            out.append("\\z" if escape == "\\Z" and not in_class else escape)
            i += 2
            if in_class and escape[1] in "dwsDWS" and i < n and pattern[i] == "-":
                out.append("\\-")
                i += 1
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":
                out.append("\\]")
                i += 1
            continue
        if ch == "]" and in_class:
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)


def has_lookaround(pattern: str) -> bool:
    return any(marker in pattern for marker in _LOOKAROUND)


def strip_lookaround(pattern: str) -> str | None:
    """`pattern` without its look-around assertions: a pattern matching every string the original
    matches (assertions only restrict). None where removing one would change what a quantifier
    applies to ("a(?=b)*")."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i : i + 2])
            i += 2
        elif ch == "[":
            end = _class_end(pattern, i)
            out.append(pattern[i:end])
            i = end
        elif pattern.startswith(_LOOKAROUND, i):
            i = _group_end(pattern, i)
            if i < n and pattern[i] in "*+?{":
                return None
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _class_end(pattern: str, start: int) -> int:
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _group_end(pattern: str, start: int) -> int:
    depth, i = 0, start
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(pattern)
