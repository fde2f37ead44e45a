"""A decode loop without a model: seeded random logits over a vocabulary padded to a multiple of 64
(like a model's lm_head), masked by the grammar, sampled at temperature 1.0; and output checks."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import json
import math
import re
import sys
import types
from collections.abc import Iterator

import jsonschema
import torch
from tokenizers import Tokenizer

from grammar import CompiledGrammar, TokenizerInfo, allocate_bitmask, apply_bitmask, fill_bitmasks

KINDS = ("byte_bpe", "sentencepiece")


def padded(vocab_size: int) -> int:
    return (vocab_size + 63) // 64 * 64 + 64


def sample_constrained(compiled: CompiledGrammar, info: TokenizerInfo, seed: int,
                       max_tokens: int = 160) -> tuple[list[int], str]:
    """Token ids (without EOS) and "stop" | "length" for one seeded temperature-1.0 sample."""
    matcher = compiled.matcher()
    bitmask = allocate_bitmask(1, info.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        fill_bitmasks([matcher], bitmask)
        logits = torch.randn(1, padded(info.vocab_size), generator=generator)  # (1, V_padded)
        apply_bitmask(logits, bitmask, [0])
        token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        assert token < info.vocab_size, f"padded id {token} was sampled"
        assert token not in info.special_token_ids or token in info.eos_token_ids, f"special {token}"
        assert matcher.accept_token(token), f"matcher refused its own allowed token {token}"
        if token in info.eos_token_ids:
            return ids, "stop"
        ids.append(token)
        if matcher.is_terminated():
            return ids, "stop"
    return ids, "length"



def decode(tokenizer: Tokenizer, info: TokenizerInfo, ids: list[int]) -> str:
    """Decode with the tokenizer and check it agrees with TokenizerInfo's bytes.

    The SentencePiece decoder strips one leading space ("▁" of the first word), nothing else.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    raw = b"".join(info.token_bytes[i] or b"" for i in ids).decode("utf-8")
    expected = raw[1:] if info.kind == "sentencepiece" and raw.startswith(" ") else raw
    assert text == expected, (text, raw)
    return text


_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$", re.ASCII)


def validate(value, schema: dict) -> None:
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    if schema.get("format") == "date-time":  # jsonschema skips date-time without rfc3339-validator
        assert _RFC3339.match(value), value
        leap_second_as_59 = value[:17] + "59" + value[19:] if value[17:19] == "60" else value  # RFC 3339 allows :60
        datetime.datetime.fromisoformat(leap_second_as_59.upper())


_TABLES: dict[str, tuple[dict[bytes, int], int]] = {}


def _token_table(info: TokenizerInfo) -> tuple[dict[bytes, int], int]:
    """{token bytes: lowest id} and the longest token's length, built once per vocabulary."""
    if info.fingerprint not in _TABLES:
        table: dict[bytes, int] = {}
        for token_id, piece in enumerate(info.token_bytes):
            if piece:
                table.setdefault(piece, token_id)
        _TABLES[info.fingerprint] = (table, max(len(p) for p in table))
    return _TABLES[info.fingerprint]


def greedy_ids(info: TokenizerInfo, text: str) -> list[int]:
    """Some token split of `text` (longest byte match first): the grammar must accept any split."""
    table, longest = _token_table(info)
    data, ids, pos = text.encode(), [], 0
    while pos < len(data):
        for length in range(min(longest, len(data) - pos), 0, -1):
            if data[pos : pos + length] in table:
                ids.append(table[data[pos : pos + length]])
                pos += length
                break
        else:
            raise AssertionError(f"no token covers byte {data[pos]} of {text!r}")
    return ids


def accepts(compiled: CompiledGrammar, info: TokenizerInfo, text: str) -> bool:
    """The grammar takes `text` token by token and may end there (EOS allowed)."""
    matcher = compiled.matcher()
    return all(matcher.accept_token(t) for t in greedy_ids(info, text)) and matcher.is_accepting()


def json_spellings(value) -> list[str]:
    """The compact JSON spellings of a scalar that a grammar may pick one of: a string with DEL raw or
    escaped (llguidance escapes it) or all non-ASCII escaped; a float as Python writes it, without the
    exponent's "+", or in plain decimals (llguidance's bounded numbers have no exponent)."""
    first = json.dumps(value, ensure_ascii=False)
    spellings = [first]
    if isinstance(value, str):
        spellings += [first.replace("\x7f", "\\u007f"), json.dumps(value)]
    elif isinstance(value, float) and math.isfinite(value):
        spellings += [first.replace("e+", "e"), format(decimal.Decimal(first), "f")]
    return list(dict.fromkeys(spellings))


def property_rank(schema, canonical: bool = True) -> dict[str, int]:
    """A first guess at the order a grammar of `schema` wants keys in: every name under a "properties"
    of the schema, sorted (`canonical`: loraplex compiles the canonical, key-sorted schema) or in the
    order they first appear (peers compile the document as written). Names not listed go after."""
    names: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                names.extend(node["properties"])
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
    unique = list(dict.fromkeys(names))
    return {name: i for i, name in enumerate(sorted(unique) if canonical else unique)}


def accepts_in_some_order(compiled: CompiledGrammar, info: TokenizerInfo, instance,
                          budget: int = 2_000_000, key_rank: dict[str, int] | None = None) -> bool:
    """Whether the grammar takes `instance` in some key order and spelling (`accepted_text`)."""
    return accepted_text(compiled, info, instance, budget, key_rank) is not None


def accepted_text(compiled: CompiledGrammar, info: TokenizerInfo, instance,
                  budget: int = 2_000_000, key_rank: dict[str, int] | None = None) -> str | None:
    """The text (or None) in which the grammar takes `instance` serialized compactly with its object keys in some order (a grammar
    fixes one order of properties; which one follows from how the backend merged the schema), and may
    end there. Depth-first over key orders on one matcher: each piece (a key, a scalar, a bracket) is fed
    as its own tokens and rolled back when its branch fails, so a prefix is never fed twice; a branch
    dies at its first refused token. `key_rank` (property_rank) only orders the tries of an object's
    keys: known properties first, in the grammar's likely order. `budget` bounds the tokens fed over the whole search (a search over
    it is an error, never a pass). Any object `compiled` whose matchers have accept_token, rollback,
    is_accepting and fill_bitmask will do (bench/grammar_corpus.py passes peer engines)."""
    matcher = compiled.matcher()
    rank = key_rank or {}
    fed = [0]
    path: list[str] = []  # the pieces fed so far
    mask = allocate_bitmask(1, info.vocab_size)
    failed: set[tuple] = set()
    keep: list = []
    texts: dict[tuple, str] = {}  # (id of a container of `instance`, mask where it began) -> its text
    dead: set[tuple] = set()  # such keys of containers that did not complete

    def feed(piece: str) -> int | None:
        """Feed `piece`; its token count, or None (and nothing fed) if the grammar refuses it."""
        ids = greedy_ids(info, piece)
        fed[0] += len(ids)
        if fed[0] > budget:
            raise AssertionError(f"key-order search fed over {budget} tokens for {instance!r:.200}")
        for n, token in enumerate(ids):
            if not matcher.accept_token(token):
                matcher.rollback(n)
                return None
        return len(ids)

    def piece(text: str, then) -> bool:
        n = feed(text)
        if n is None:
            return False
        path.append(text)
        if then():
            return True
        path.pop()
        matcher.rollback(n)
        return False

    def scalar(prefix: str, value, suffix: str, then) -> bool:
        """The first of the value's spellings whose piece the grammar takes, then `then` (a spelling
        the grammar refuses is no branch: each scalar is complete within its piece)."""
        for spelling in json_spellings(value):
            n = feed(prefix + spelling + suffix)
            if n is not None:
                matcher.rollback(n)
                return piece(prefix + spelling + suffix, then)
        return False

    def emit(value, then) -> bool:
        if not isinstance(value, dict | list):
            return scalar("", value, "", then)
        # NOTE: a container re-emitted (another order of its parent's keys) from a state with the same
        # next-token mask is fed as the text found for it before, in one piece, not searched again:
        # else a wrong order of big siblings is only found after re-searching all of them.
        # One that never completed from such a state (whatever followed it) fails again at once.
        matcher.fill_bitmask(mask, 0)
        known = (id(value), mask.numpy().tobytes())
        if known in texts and piece(texts[known], then):  # else (another state, same mask) search it again
            return True
        if known in dead:
            return False
        start = len(path)

        def done() -> bool:
            texts[known] = "".join(path[start:])
            return then()

        if isinstance(value, dict):
            ok = piece("{", lambda: members(list(value.items()), True, done))
        else:
            ok = piece("[", lambda: elements(value, True, done))
        if not ok and known not in texts:  # NOTE: like `failed`, it can only turn a pass into a failure
            dead.add(known)
        return ok

    def members(remaining: list, first: bool, then) -> bool:
        if not remaining:
            return piece("}", then)
        # NOTE: members that failed from a matcher state with the same next-token mask, the same keys
        # left and the same continuation are not tried again: without it, keys the grammar takes in any
        # order (additionalProperties) are permuted n! times before a later key is found unplaceable.
        # Skipping a branch can only turn a pass into a failure, never the reverse.
        matcher.fill_bitmask(mask, 0)
        seen = (id(then), frozenset(k for k, _ in remaining), first, mask.numpy().tobytes())
        if seen in failed:
            return False
        tries = sorted(range(len(remaining)), key=lambda i: rank.get(remaining[i][0], len(rank)))
        for i in tries:
            key, value = remaining[i]
            rest = remaining[:i] + remaining[i + 1:]
            if scalar("" if first else ",", key, ":",
                      lambda value=value, rest=rest: emit(value, lambda: members(rest, False, then))):
                return True
        failed.add(seen)
        keep.append(then)  # its id stays unique while `failed` holds it
        return False

    def elements(remaining: list, first: bool, then) -> bool:
        if not remaining:
            return piece("]", then)
        return piece("" if first else ",", lambda: emit(remaining[0], lambda: elements(remaining[1:], False, then)))

    # at the end, the same text in another token split (longest match over the whole text) must pass too
    with _recursion_limit(SEARCH_RECURSION_LIMIT):
        found = emit(instance, lambda: matcher.is_accepting() and accepts(compiled, info, "".join(path)))
    return "".join(path) if found else None


# The search recurses once per piece it feeds (continuation passing), a few frames each: a big corpus
# instance (a Kubernetes list, a long array) is thousands of pieces. Python-to-Python calls do not grow
# the C stack in CPython 3.11+, so a higher limit only costs heap frames.
SEARCH_RECURSION_LIMIT = 200_000


@contextlib.contextmanager
def _recursion_limit(limit: int) -> Iterator[None]:
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


class _CompatMany:
    """hypothesis-jsonschema 0.23 drives hypothesis' private `many` with .more(); newer hypothesis
    iterates it instead. This adapter gives the old interface over the new one (tests and benches only)."""

    def __init__(self, data, min_size, max_size, average_size):
        from hypothesis.internal.conjecture.utils import many

        self._many = many(data, min_size=min_size, max_size=max_size, average_size=average_size)
        self._many.__enter__()
        self._steps = iter(self._many)

    def more(self) -> bool:
        try:
            next(self._steps)
            return True
        except StopIteration:
            self._many.__exit__(None, None, None)
            return False

    def reject(self, why=None) -> None:
        self._many.reject()


@contextlib.contextmanager
def hypothesis_jsonschema_compat() -> Iterator[None]:
    """While open, hypothesis-jsonschema draws through `_CompatMany`."""
    import hypothesis.internal.conjecture.utils as cu
    import hypothesis_jsonschema._from_schema as from_schema_module

    shim = types.SimpleNamespace(**{name: getattr(cu, name) for name in dir(cu) if not name.startswith("__")})
    shim.many = _CompatMany
    saved, from_schema_module.cu = from_schema_module.cu, shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        from_schema_module.cu = saved  # type: ignore[attr-defined]


def ascii_class_validator(schema: dict):
    """schema_validator, but with \\d and \\w in patterns ASCII as ECMA-262 (which JSON Schema patterns
    follow, and the grammar with it) reads them; Python reads them as Unicode classes, so "߄s" would
    pass for ^\\d+s$. Only used to keep the instances that are valid in both readings."""
    import regex
    from jsonschema import ValidationError
    from jsonschema.validators import extend

    def ascii_pattern(text: str):
        return regex.compile(text, flags=regex.ASCII | regex.V0)

    def pattern(validator, value, instance, schema):
        if validator.is_type(instance, "string") and not ascii_pattern(value).search(instance):
            yield ValidationError(f"{instance!r} does not match {value!r}")

    def pattern_properties(validator, value, instance, schema):
        if validator.is_type(instance, "object"):
            for regex_text, subschema in value.items():
                for name, item in instance.items():
                    if ascii_pattern(regex_text).search(name):
                        yield from validator.descend(item, subschema, path=name, schema_path=regex_text)

    from grammar.guard import schema_validator

    base = schema_validator(schema)
    cls = extend(type(base), {"pattern": pattern, "patternProperties": pattern_properties})
    return cls(schema, format_checker=base.format_checker)
