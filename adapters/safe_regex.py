"""Compile tenant-supplied regular expressions (PEFT target/exclude/rank patterns) without ReDoS risk.

PEFT lets `target_modules`, `exclude_modules`, `rank_pattern` and `alpha_pattern` be regexes. They come
from an uploaded adapter_config.json, and Python's `re` has no timeout, so a pattern like `(a+)+b` could
pin a gateway core. Module names are short, so the only real danger is exponential backtracking, which
needs a repetition nested inside another repetition (or an alternation under a repetition). Those are
refused; every pattern PEFT documents (`.*\\.(q|v)_proj`, `model.layers.0.self_attn.q_proj`, ...) passes.
"""

from __future__ import annotations

import re

# NOTE: re._parser is CPython's own regex parser (sre_parse before 3.11); the pinned Python is 3.11.
from re import _parser as sre_parser  # type: ignore[attr-defined]

from adapters.errors import AdapterError

MAX_PATTERN_CHARS = 512
# Sequential unbounded repetitions backtrack polynomially (n ** count) on a miss; module names are ~40
# characters, so three keep a miss under a few million steps.
MAX_REPETITIONS = 3
_REPEATS = {sre_parser.MAX_REPEAT, sre_parser.MIN_REPEAT, sre_parser.POSSESSIVE_REPEAT}


def compile_bounded_regex(pattern: str, field: str) -> re.Pattern[str]:
    """Compile `pattern` (from config field `field`) or raise AdapterError naming the field.

    Refuses patterns over MAX_PATTERN_CHARS, patterns with a repetition (max > 1) whose body holds
    another repetition or an alternation (exponential backtracking), and patterns with more than
    MAX_REPETITIONS repetitions (polynomial backtracking).
    """
    if not isinstance(pattern, str):
        raise AdapterError(
            f"adapter_config.json: {field} must be a string pattern, got {type(pattern).__name__}"
        )
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(
            f"adapter_config.json: {field} pattern is longer than {MAX_PATTERN_CHARS} characters"
        )
    try:
        parsed = sre_parser.parse(pattern)
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise AdapterError(f"adapter_config.json: {field} is not a valid regex ({pattern!r}: {e})") from None
    if _has_nested_repetition(parsed, inside_repeat=False):
        raise AdapterError(
            f"adapter_config.json: {field} regex {pattern!r} nests a repetition or alternation inside a "
            "repetition (refused: it can backtrack exponentially)"
        )
    if _count_repetitions(parsed) > MAX_REPETITIONS:
        raise AdapterError(
            f"adapter_config.json: {field} regex {pattern!r} has more than {MAX_REPETITIONS} repetitions "
            "(refused: it can backtrack for a very long time)"
        )
    return compiled


def _count_repetitions(items) -> int:
    count = 0
    for op, arg in items:
        if op in _REPEATS:
            high = arg[1]
            count += int(high is sre_parser.MAXREPEAT or high > 1) + _count_repetitions(arg[2])
        elif op is sre_parser.SUBPATTERN:
            count += _count_repetitions(arg[-1])
        elif op is sre_parser.BRANCH:
            count += sum(_count_repetitions(branch) for branch in arg[1])
        elif op in (sre_parser.ASSERT, sre_parser.ASSERT_NOT):
            count += _count_repetitions(arg[1])
        elif op is sre_parser.ATOMIC_GROUP:
            count += _count_repetitions(arg)
        elif op is sre_parser.GROUPREF_EXISTS:
            count += _count_repetitions(arg[1]) + (_count_repetitions(arg[2]) if arg[2] else 0)
    return count


def _has_nested_repetition(items, inside_repeat: bool) -> bool:
    for op, arg in items:
        if op in _REPEATS:
            low, high, body = arg
            repeats = high is sre_parser.MAXREPEAT or high > 1
            if repeats and inside_repeat:
                return True
            if _has_nested_repetition(body, inside_repeat or repeats):
                return True
        elif op is sre_parser.BRANCH:
            if inside_repeat:
                return True
            if any(_has_nested_repetition(branch, inside_repeat) for branch in arg[1]):
                return True
        elif op is sre_parser.IN:
            continue
        elif op is sre_parser.SUBPATTERN:
            if _has_nested_repetition(arg[-1], inside_repeat):
                return True
        elif op in (sre_parser.ASSERT, sre_parser.ASSERT_NOT):
            if _has_nested_repetition(arg[1], inside_repeat):
                return True
        elif op is sre_parser.GROUPREF_EXISTS:
            _, yes, no = arg
            if _has_nested_repetition(yes, inside_repeat) or (
                no and _has_nested_repetition(no, inside_repeat)
            ):
                return True
        elif op is sre_parser.ATOMIC_GROUP and _has_nested_repetition(arg, inside_repeat):
            return True
    return False
